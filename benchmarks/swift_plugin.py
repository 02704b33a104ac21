"""ms-swift plugin for benchmarks/vs_swift.py: streamrl's prompt format, reward and step clock.

Loaded by `swift rlhf --external_plugins benchmarks/swift_plugin.py` in ms-swift's own virtual
environment (`make install-swift`), never by streamrl. It reads the run's spec, a JSON file
written by vs_swift.py and named by `STREAMRL_SWIFT_SPEC`, and registers, by ms-swift's
documented plugin mechanism:

- template `streamrl_chat`: the policy's own chat template (a one-turn user message and the
  opening of the assistant turn, rendered by vs_swift.py from the tokenizer), so that ms-swift's
  engine receives exactly the prompt ids streamrl's engine receives; checked when training
  starts against the ids in the spec;
- reward `streamrl_reward` (`--reward_funcs`): streamrl's reward function itself (imported from
  this repository; the reward modules need neither torch nor Ray), applied as streamrl's reward
  role applies it: the response token ids decoded with special tokens skipped, an unscorable
  answer given the task's `invalid_output` penalty. It also records, per step, the completion
  tokens and the share of samples in groups whose rewards were all equal;
- callback `streamrl_step_clock` (`--callbacks`): the time of every optimizer step's end, like
  vs_trl.py's clock for TRL.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

SPEC = json.loads(Path(os.environ["STREAMRL_SWIFT_SPEC"]).read_text())
sys.path.insert(0, SPEC["repo"])

from swift.callbacks import TrainerCallback, callbacks_map  # noqa: E402
from swift.rewards import ORM, orms  # noqa: E402
from swift.template import TemplateMeta, register_template  # noqa: E402

from streamrl.reward.scoring import resolve_callable, score_text  # noqa: E402

register_template(
    TemplateMeta(
        template_type="streamrl_chat",
        prefix=[],
        prompt=[SPEC["prompt_template"]],  # e.g. "<|user|>{{QUERY}}<|end|><|assistant|>"
        chat_sep=None,  # one turn only
        suffix=[["eos_token_id"]],
    )
)


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class StreamrlReward(ORM):
    """streamrl's reward in ms-swift's ORM signature (called once per step, every completion)."""

    def __init__(self, args=None, **kwargs) -> None:
        super().__init__(args, **kwargs)
        from transformers import AutoTokenizer

        self.reward_fn = resolve_callable(SPEC["reward_function"])
        self.penalty = SPEC["invalid_output_penalty"]
        self.group_size = SPEC["group_size"]
        self.tokenizer = AutoTokenizer.from_pretrained(SPEC["model_dir"])

    def __call__(self, completions, streamrl_answer, response_token_ids, **kwargs) -> list[float]:
        texts = self.tokenizer.batch_decode(
            [list(ids) for ids in response_token_ids], skip_special_tokens=True
        )
        rewards = []
        for text, answer in zip(texts, streamrl_answer, strict=True):
            result = score_text(self.reward_fn, text, SimpleNamespace(answer=answer, extra={}))
            rewards.append(result.value if result.status == "ok" else self.penalty)
        # ms-swift lays a step's completions out group by group (each prompt's G in a row).
        g = self.group_size
        groups = [rewards[i : i + g] for i in range(0, len(rewards), g)]
        _append(
            SPEC["steps_out"],
            {
                "tokens": sum(len(ids) for ids in response_token_ids),
                "zero_adv": sum(len(x) for x in groups if len(set(x)) == 1) / len(rewards),
                "reward_mean": sum(rewards) / len(rewards),
                "sample": texts[0],
            },
        )
        return rewards


class StepClock(TrainerCallback):
    """Marks the start of training and the end of every optimizer step; checks the prompts."""

    def on_train_begin(self, args, state, control, **kwargs):
        template = self.trainer.template
        for text, ids in SPEC["prompts"]:
            encoded = template.encode({"messages": [{"role": "user", "content": text}]})
            if list(encoded["input_ids"]) != ids:
                raise RuntimeError(
                    f"ms-swift encodes prompt {text!r} as {encoded['input_ids']}, "
                    f"streamrl's engine receives {ids}"
                )
        self.num_prompts_checked = len(SPEC["prompts"])
        self.marks = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append(time.perf_counter())

    def on_train_end(self, args, state, control, **kwargs):
        record = {"marks": self.marks, "num_prompts_checked": self.num_prompts_checked}
        Path(SPEC["clock_out"]).write_text(json.dumps(record))


orms["streamrl_reward"] = StreamrlReward
callbacks_map["streamrl_step_clock"] = StepClock
