"""`streamrl eval`: held-out greedy accuracy of a model, measured as a run measures it, and
pass@k from several sampled answers a prompt (`--samples K`).

The target is a run directory (its latest checkpoint's model, with the run's own config: the
same held-out prompts, reward and response length, so a finished run's figure is its
`final_eval_accuracy`) or any local model directory (with the embedded defaults). Overrides
change what is measured: `data.eval_file=other.jsonl`, `data.num_eval=1000`,
`reward.function=...`. With `--samples K` each prompt is also answered K times at the run's
sampling temperature (or `--temperature T`), and pass@1 (the mean accuracy of one sample) to
pass@K are reported, estimated without bias from the K samples.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from streamrl.config import Config, ConfigError, load_config
from streamrl.data.dataset import PromptRow
from streamrl.metrics.progress import phase
from streamrl.runtime.preflight import check_paths
from streamrl.trainer.evaluate import EvalResult, SampledResult, report_ks


@dataclass(frozen=True)
class Evaluation:
    model_dir: Path
    cfg: Config
    rows: list[PromptRow]
    result: EvalResult
    sampled: SampledResult | None = None

    @property
    def num_prompts(self) -> int:
        return len(self.rows)

    def misses(self, num: int) -> str:
        """The first `num` held-out prompts answered wrong (or not scored): prompt, reference
        answer, the model's response and the reward's verdict."""
        blocks = []
        for index, response, score in self.result.misses[:num]:
            row = self.rows[index]
            verdict = f"{score.value}" if score.status == "ok" else score.status
            blocks.append(
                f"[{index}] prompt: {row.prompt!r}\n    answer: {row.answer!r}\n"
                f"    response: {response!r}\n    reward: {verdict}"
                + (f" ({score.reason})" if score.reason else "")
            )
        return "\n".join(blocks)

    def as_dict(self) -> dict:
        """The figures as JSON-able values (`streamrl eval --json`)."""
        out = {
            "model_dir": str(self.model_dir),
            "num_prompts": self.num_prompts,
            "accuracy": self.result.accuracy,
            "unscored": dict(self.result.unscored),
            "max_new_tokens": self.cfg.rollout.max_new_tokens,
            "reward": self.cfg.reward.function,
        }
        if self.sampled is not None:
            out["samples"] = self.sampled.samples
            out["temperature"] = self.sampled.temperature
            out["pass_at"] = {k: self.sampled.pass_at(k) for k in report_ks(self.sampled.samples)}
            out["sampled_unscored"] = dict(self.sampled.unscored)
        return out

    def report(self) -> str:
        r = self.result
        line = (
            f"{self.model_dir}: held-out accuracy {r.accuracy:.4f} "
            f"({round(r.accuracy * self.num_prompts)} of {self.num_prompts} prompts, greedy, "
            f"at most {self.cfg.rollout.max_new_tokens} new tokens, reward "
            f"{self.cfg.reward.function})"
        )
        if r.unscored:
            line += f"; {r.unscored_text()}, counted as not correct"
        if self.sampled is not None:
            line += f"\n{self.model_dir}: {self.sampled.text()}"
        return line


def target_config(target: Path, overrides: list[str]) -> tuple[Config, Path]:
    """The config and model directory `streamrl eval TARGET overrides` measures."""
    from streamrl.trainer.checkpoint import latest_model_dir

    if (target / "config.yaml").is_file():  # a run directory
        model_dir = latest_model_dir(target)
        if model_dir is None:
            raise ConfigError(f"{target} has no checkpoint yet: nothing trained to evaluate")
        cfg = load_config([str(target / "config.yaml"), *overrides])
        return cfg, model_dir
    if (target / "config.json").is_file():  # a model directory
        return load_config([*overrides, f"model.path={target}"]), target
    raise ConfigError(
        f"{target} is neither a run directory (config.yaml) nor a model directory (config.json)"
    )


def evaluate(
    target: Path, overrides: list[str], *, samples: int = 0, temperature: float | None = None
) -> Evaluation:
    """Greedy accuracy of TARGET's model; with `samples` > 0 also pass@k from that many answers
    a prompt at `temperature` (None: the config's `rollout.temperature`)."""
    from streamrl.models.loading import load_policy_model
    from streamrl.runtime.context import prepare
    from streamrl.trainer.evaluate import Evaluator

    cfg, model_dir = target_config(target, overrides)
    temperature = cfg.rollout.temperature if temperature is None else temperature
    if samples < 0 or (samples and temperature <= 0):
        raise ConfigError(
            f"--samples {samples} --temperature {temperature}: pass@k needs --samples >= 1 "
            "and a temperature > 0 (greedy answers are measured anyway)"
        )
    check_paths(cfg)
    sampled = None
    with tempfile.TemporaryDirectory(prefix="streamrl-eval-") as scratch:
        ctx = prepare(cfg, model_dir, Path(scratch))
        evaluator = Evaluator(ctx, load_policy_model(ctx, "rollout.device"))
        try:
            result = evaluator.evaluate()
            if samples:
                # On stderr: stdout is for the figures (`--json` prints nothing else there).
                label = f"sampling {samples} answers a prompt"
                with phase(label, total=samples, console=Console(stderr=True)) as advance:
                    sampled = evaluator.sample(samples, temperature, advance)
        finally:
            evaluator.close()
    return Evaluation(model_dir, cfg, ctx.eval_rows, result, sampled)
