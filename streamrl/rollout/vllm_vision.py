"""vLLM's inputs for a multimodal (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; Qwen2.5-Omni thinker) policy,
and the processes that need the torchvision shims.

A request's media go to vLLM as `multi_modal_data` (`VisionInputs`), which runs the model
directory's processor on them again. vLLM 0.32 expands every placeholder token of a token prompt
it is given media for, also one already expanded (11 prompt tokens came out as 14, silently), so
each medium's run of placeholders is collapsed back to one token before it goes in, and vLLM's
expanded prompt is checked against the request's when the request finishes
(`vllm_replica.Replica.step`). The placeholder tokens are never sampled: they are vLLM
`bad_words`, whose mask (-inf) is applied before the processed log-probs are taken, so the
log-probs are those of the distribution renormalised without them, as the trainer's are
(`models/vision.py`).

Torchvision-free processing needs the shims of `models/processors.py` in every process where
vLLM reads the model: the one that starts it (`vllm_replica.start_llm`); an engine core in a
process of its own, whose executor (vLLM's, subclassed here: `vision_executor`) installs them
first; and that executor's worker processes, which import `vllm_replica` (the worker extension)
before they load the model and install them when `SHIMS_ENV` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamrl.api.engine import GenerationRequest
from streamrl.config.schema import VllmConfig
from streamrl.media.prepare import VIDEO_FPS, VIDEO_FRAMES

# Set (to "1") in the environment the processes of a vision-language model's engine start with:
# a vLLM worker process imports this module as the worker extension before it loads the model,
# and installs the torchvision shims then (bottom of this module).
SHIMS_ENV = "STREAMRL_VLLM_VISION_SHIMS"


QWEN_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# vLLM runs the thinker of a Qwen2.5-Omni model directory (its config the Omni one).
OMNI_MODEL_TYPE = "qwen2_5_omni"


def audio_tokens(num_frames: int) -> int:
    """How many placeholder tokens an audio clip of `num_frames` log-mel frames expands to (the
    audio tower's two stride-2 steps, as the Omni processor and vLLM count them)."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


@dataclass(frozen=True)
class VisionInputs:
    """How a Qwen-VL or Omni thinker's requests reach vLLM: the placeholder token of each kind,
    how many a medium expands to (`merge_size`), and the placeholders as the `bad_words` that
    keep them from being sampled."""

    placeholders: dict[str, int]
    bad_words: tuple[str, ...]
    merge_size: int
    # Qwen3-VL: (vision start, vision end) token ids, between which each time step of a video
    # sits after its timestamp; None for models that write a video as one run of placeholders.
    video_steps: tuple[int, int] | None = None

    @classmethod
    def of(cls, hf_config: Any, tokenizer: Any) -> VisionInputs:
        """From vLLM's model config and tokenizer; raises if the model is not a Qwen-VL one or
        its placeholder tokens would not be masked exactly (each one bad word of one token)."""
        from vllm import SamplingParams as VllmSamplingParams

        model_type = getattr(hf_config, "model_type", None)
        if model_type not in (*QWEN_VL_MODEL_TYPES, OMNI_MODEL_TYPE):
            raise ValueError(
                "the vLLM engine takes media for Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen2.5-Omni "
                "models "
                f"only (model types {(*QWEN_VL_MODEL_TYPES, OMNI_MODEL_TYPE)}); this multimodal "
                f"model's is {model_type!r}: use rollout.engine=builtin"
            )
        if model_type == OMNI_MODEL_TYPE:
            hf_config = hf_config.thinker_config
        vision = hf_config.vision_config
        placeholders = {"image": hf_config.image_token_id, "video": hf_config.video_token_id}
        if model_type == OMNI_MODEL_TYPE:
            placeholders["audio"] = hf_config.audio_token_id
        words = tuple(tokenizer.convert_ids_to_tokens(list(placeholders.values())))
        probe = VllmSamplingParams(bad_words=list(words))
        probe.update_from_tokenizer(tokenizer)
        if probe.bad_words_token_ids != [[i] for i in placeholders.values()]:
            raise ValueError(
                f"the placeholder tokens {words} do not each encode to their own single id "
                f"({probe.bad_words_token_ids} for {list(placeholders.values())}), so vLLM's "
                "bad_words cannot keep exactly them from being sampled; check the tokenizer's "
                "added tokens"
            )
        steps = None
        if model_type == "qwen3_vl":
            steps = (hf_config.vision_start_token_id, hf_config.vision_end_token_id)
        return cls(
            placeholders,
            words,
            int(vision.spatial_merge_size),
            steps,
        )

    def prompt(self, request: GenerationRequest, response_ids: Sequence[int]) -> dict[str, Any]:
        """vLLM's `TokensPrompt` for `request` continued by `response_ids`: each medium's run of
        placeholders collapsed to one token (vLLM expands it again), and the media as
        `multi_modal_data`, named by the request's media key so vLLM need not hash pixels."""
        from vllm.inputs import TokensPrompt

        media = request.media
        if not media:
            if set(np.asarray(request.prompt_ids).tolist()) & set(self.placeholders.values()):
                raise ValueError(
                    f"request {request.request_id!r} holds media placeholder tokens but no "
                    "media; a multimodal prompt needs its `media`"
                )
            return TokensPrompt(prompt_token_ids=[*map(int, request.prompt_ids), *response_ids])
        sizes = self._sizes(request)
        ids = self._collapse(request, sizes)
        data: dict[str, list[Any]] = {"image": [], "video": [], "audio": []}
        uuids: dict[str, list[str]] = {"image": [], "video": [], "audio": []}
        rates, sampled = media.get(VIDEO_FPS), media.get(VIDEO_FRAMES)
        first_frame = 0  # the current video's first entry in `sampled`
        for i, (kind, array) in enumerate(media["decoded"]):
            if kind == "audio":
                # Samples at the feature extractor's rate: the feeder's processor (the model
                # directory's) took the very same ones.
                data["audio"].append(np.asarray(array, dtype=np.float32))
            elif kind == "image":
                from PIL import Image

                data["image"].append(Image.fromarray(np.asarray(array, dtype=np.uint8)))
            else:
                if rates is None or sampled is None:
                    raise ValueError(
                        f"request {request.request_id!r}: its video comes without the frame "
                        f"rate and frame indices the feeder stores with it ({VIDEO_FPS}, "
                        f"{VIDEO_FRAMES}); prepare multimodal prompts with the feeder's preparer"
                    )
                indices = sampled[first_frame : first_frame + len(array)]
                first_frame += len(array)
                fps = float(rates[len(data["video"])])
                frames = np.asarray(array, dtype=np.uint8)
                data["video"].append((frames, self._metadata(fps, indices)))
            uuids[kind].append(f"{media.get('key')}.{i}")
        data = {kind: items for kind, items in data.items() if items}
        prompt = TokensPrompt(prompt_token_ids=[*ids, *response_ids], multi_modal_data=data)
        if media.get("key"):
            prompt["multi_modal_uuids"] = {kind: uuids[kind] for kind in data}
        return prompt

    def _sizes(self, request: GenerationRequest) -> list[tuple[str, int, int]]:
        """(kind, placeholder tokens, time steps) of each medium of `request`, in prompt
        order."""
        media = request.media
        assert media is not None
        grids = {"image": media.get("image_grid_thw"), "video": media.get("video_grid_thw")}
        frames = media.get("feature_attention_mask")
        sizes, used = [], {"image": 0, "video": 0, "audio": 0}
        for kind, _ in media["decoded"]:
            if kind not in self.placeholders:
                raise ValueError(
                    f"request {request.request_id!r} holds a medium of kind {kind!r}; this "
                    f"model takes {', '.join(self.placeholders)}"
                )
            if kind == "audio":
                if frames is None or used["audio"] >= len(frames):
                    raise ValueError(
                        f"request {request.request_id!r}: its media have no "
                        f"feature_attention_mask entry for audio {used['audio']}"
                    )
                tokens = audio_tokens(int(np.asarray(frames[used["audio"]]).sum()))
                sizes.append(("audio", tokens, 1))
                used["audio"] += 1
                continue
            grid = grids[kind]
            if grid is None or used[kind] >= len(grid):
                raise ValueError(
                    f"request {request.request_id!r}: its media have no {kind}_grid_thw entry "
                    f"for {kind} {used[kind]}"
                )
            t, h, w = (int(x) for x in np.asarray(grid[used[kind]]))
            sizes.append((kind, t * h * w // self.merge_size**2, t))
            used[kind] += 1
        return sizes

    def _collapse(self, request: GenerationRequest, sizes: list[tuple[str, int, int]]) -> list[int]:
        """The prompt with each medium's `size` placeholders replaced by one (a Qwen3-VL
        video's time steps with their timestamps, `_collapse_steps`)."""
        ids = [int(t) for t in request.prompt_ids]
        out, pos, media = [], 0, iter(sizes)
        kind_of = {token: kind for kind, token in self.placeholders.items()}
        while pos < len(ids):
            token = ids[pos]
            if token not in kind_of:
                out.append(token)
                pos += 1
                continue
            kind, size, steps = next(media, (None, 0, 1))
            if kind == "video" == kind_of[token] and self.video_steps is not None:
                pos = self._collapse_steps(request, ids, pos, out, steps, size // steps)
                continue
            if kind != kind_of[token] or ids[pos : pos + size] != [token] * size:
                raise ValueError(
                    f"request {request.request_id!r}: the {kind_of[token]} placeholders at "
                    f"position {pos} do not match its media (next: {kind}, {size} tokens)"
                )
            out.append(token)
            pos += size
        if next(media, None) is not None:
            raise ValueError(f"request {request.request_id!r} has more media than placeholder runs")
        return out

    def _collapse_steps(
        self,
        request: GenerationRequest,
        ids: list[int],
        pos: int,
        out: list[int],
        steps: int,
        per_step: int,
    ) -> int:
        """A Qwen3-VL video at `pos` (its first placeholder), written by the processor as
        `<start>` then, per time step, `<t seconds><start>` + `per_step` placeholders + `<end>`,
        then `<end>`: what came before it since the outer `<start>` leaves `out`, one
        placeholder goes in (vLLM writes the steps again from the frames and their rate), and
        the position after the last step's `<end>` is returned."""
        start, end = self.video_steps
        token = self.placeholders["video"]
        bad = ValueError(
            f"request {request.request_id!r}: the video at position {pos} is not {steps} time "
            f"steps of {per_step} placeholders, each after its timestamp and between "
            "<|vision_start|> and <|vision_end|>"
        )
        outer = [i for i, t in enumerate(out[:-1]) if t == start]
        if not out or out[-1] != start or not outer:
            raise bad
        del out[outer[-1] + 1 :]  # the first step's timestamp and its <start>
        out.append(token)
        for step in range(steps):
            if ids[pos : pos + per_step] != [token] * per_step or ids[pos + per_step] != end:
                raise bad
            pos += per_step + 1
            if step < steps - 1:  # past the next step's timestamp and its <start>
                if start not in ids[pos:]:
                    raise bad
                pos = ids.index(start, pos) + 1
        return pos

    @staticmethod
    def _metadata(fps: float, indices: Any) -> dict[str, Any]:
        """vLLM's video metadata for the frames the feeder sampled (`indices`: which of the
        clip's frames they are), at the clip's rate `fps`: vLLM samples nothing again and
        times the frames as the feeder's processor did."""
        num_frames = len(indices)
        return {
            "fps": fps,
            "duration": num_frames / fps,
            "total_num_frames": num_frames,
            # plain ints: an engine core in its own process gets these through msgpack
            "frames_indices": [int(i) for i in indices],
            "video_backend": "opencv",
            "do_sample_frames": False,
        }


def is_vision_language_dir(model_dir: Path) -> bool:
    """Whether the model in `model_dir` has a vision tower (its `config.json` a `vision_config`,
    or a Qwen2.5-Omni thinker's, which has one too)."""
    from streamrl.models.loading import is_multimodal_dir

    return is_multimodal_dir(model_dir)


# The executors of an engine core in its own process, for a vision-language model: vLLM's own
# (the one it picks by default), installing the shims first. The engine-core process runs its
# executor's `_init_executor` before anything there needs the model class (its scheduler sizes
# the encoder budget with the model's processor). Built on first access (PEP 562 `__getattr__`)
# so that importing this module does not import vLLM; vLLM finds them by qualified name.
_VISION_EXECUTORS = {
    "VisionMultiprocExecutor": ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor"),
    "VisionUniProcExecutor": ("vllm.v1.executor.uniproc_executor", "UniProcExecutor"),
}


def vision_executor(config: VllmConfig) -> str:
    """The qualified name of the executor vLLM would pick for an engine core in its own
    process (its multiprocess one on a CPU, where vLLM requires it, or for several devices;
    else its single-process one), installing the shims first."""
    from vllm.platforms import current_platform

    world = int(config.engine_kwargs.get("tensor_parallel_size", 1)) * int(
        config.engine_kwargs.get("pipeline_parallel_size", 1)
    )
    multiprocess = current_platform.is_cpu() or world > 1
    name = "VisionMultiprocExecutor" if multiprocess else "VisionUniProcExecutor"
    return f"{__name__}.{name}"


def __getattr__(name: str) -> Any:
    if name not in _VISION_EXECUTORS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, base_name = _VISION_EXECUTORS[name]
    base = getattr(importlib.import_module(module), base_name)

    def _init_executor(self) -> None:
        from streamrl.models.processors import install_vllm_shims

        install_vllm_shims()
        base._init_executor(self)

    executor = type(
        name,
        (base,),
        {
            "__module__": __name__,
            "__doc__": f"vLLM's {base_name}, installing the torchvision shims first.",
            "_init_executor": _init_executor,
        },
    )
    globals()[name] = executor
    return executor
