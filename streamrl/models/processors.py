"""Qwen2.5-VL processors without torchvision: a numpy/PIL video processor and three small shims.

Checked on transformers 5.19 and vLLM 0.32 (CPU build), where torchvision is not installed. What
each piece works around:

- `NumpyQwen2VLVideoProcessor`: transformers' only Qwen2-VL video processor
  (`Qwen2VLVideoProcessor`) is built on torchvision, so without it there is none at all. This one
  does the same work with PIL and numpy: resize every frame like the PIL image processor does
  (bicubic, both sides multiples of `patch_size * merge_size`, area within min/max pixels),
  rescale and normalise with the image processor's mean/std, repeat the last frame up to a
  multiple of `temporal_patch_size`, and cut the frames into the patch layout the vision tower
  reads. vLLM normalises pixels on the device for Qwen-VL models (with the *image* processor's
  mean/std) and so calls it with `do_rescale=False, do_normalize=False`: it then returns resized
  raw pixel values.
- `install_transformers_shims()`: (1) `ProcessorMixin` checks a video processor's class by
  looking up `transformers.VideoProcessorMixin` and, failing that, `VIDEO_PROCESSOR_MAPPING`,
  both torchvision-only placeholders at the top level (constructing `Qwen2_5_VLProcessor` fails
  with "type object 'VIDEO_PROCESSOR_MAPPING' has no attribute '_extra_content'"): the real
  `VideoProcessorMixin` is exposed there. (2) `AutoVideoProcessor`, which `from_pretrained` uses
  for the video processor, finds no class without torchvision: the numpy one is registered for
  `Qwen2_5_VLConfig`, so a saved processor loads back.
- `install_vllm_shims()`: vLLM's Qwen-VL model files import `smart_resize` from
  `transformers.models.qwen2_vl.image_processing_qwen2_vl`, which imports torchvision at its top;
  a stand-in module with the same `smart_resize` (the PIL image processor's copy) is put in its
  place. vLLM also inspects a model class it has not imported yet in a fresh subprocess
  (`registry._run_in_subprocess`), which would lack the stand-in and fail ("Model architectures
  ['Qwen2_5_VLForConditionalGeneration'] failed to be inspected"): the class is imported here
  and registered with `ModelRegistry` directly, and so is the Qwen2.5-Omni thinker's (whose
  vLLM module imports the Qwen2.5-VL one). Also installs the transformers shims, since vLLM
  loads the processor from the model directory in the process that runs `vllm.LLM` (in-process
  engines only: an engine core in a process of its own would not have them).

Every shim applies only where torchvision is missing, and installing twice does nothing more.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.processing_utils import VideosKwargs
from transformers.utils import is_torchvision_available
from transformers.video_processing_utils import VideoProcessorMixin
from transformers.video_utils import VideoMetadata, make_batched_videos

PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
# Per processor family: (patch size, the mean and std of every channel; None: CLIP's).
PROCESSOR_FAMILIES: dict[str, tuple[int, float | None]] = {
    "qwen2_5_vl": (14, None),
    "qwen3_vl": (16, 0.5),
}
QWEN3_TINY_FRAMES = 8  # frames of the largest size a tiny Qwen3-VL's clip may have
QWEN_VL_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_VLLM_SHIMS_INSTALLED = False
# The per-call settings that fall back to the instance's (besides `size`).
SETTINGS = (
    "do_resize do_rescale rescale_factor do_normalize image_mean image_std "
    "patch_size temporal_patch_size merge_size"
).split()


class _VideoKwargs(VideosKwargs, total=False):
    """The keyword arguments the video processor takes (at construction and per call)."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int


class NumpyQwen2VLVideoProcessor(VideoProcessorMixin):
    """Qwen2-VL / Qwen2.5-VL video processor in numpy and PIL (no torchvision).

    A video is a list of frames (PIL images or HxWx3 uint8 arrays) or one (T, H, W, 3) uint8
    array; frames are used as given (no frame sampling). Returns `pixel_values_videos`
    (num_patches, 3 * temporal_patch_size * patch_size**2) and `video_grid_thw` (num_videos, 3),
    plus `video_metadata` when `return_metadata` is set (the Qwen2.5-VL processor reads the
    sampled fps from it to time the video's positions).
    """

    model_input_names = ["pixel_values_videos", "video_grid_thw"]
    valid_kwargs = _VideoKwargs

    def __init__(
        self,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        size: dict[str, int] | None = None,
        do_resize: bool = True,
        do_rescale: bool = True,
        rescale_factor: float = 1 / 255,
        do_normalize: bool = True,
        image_mean: list[float] | None = None,
        image_std: list[float] | None = None,
        patch_size: int = PATCH_SIZE,
        temporal_patch_size: int = TEMPORAL_PATCH_SIZE,
        merge_size: int = MERGE_SIZE,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("video_processor_type", None)
        kwargs.pop("image_processor_type", None)
        super().__init__(**kwargs)
        size = dict(size or {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280})
        if min_pixels is not None:
            size["shortest_edge"] = min_pixels
        if max_pixels is not None:
            size["longest_edge"] = max_pixels
        self.size = size
        self.do_resize = do_resize
        self.do_rescale = do_rescale
        self.rescale_factor = rescale_factor
        self.do_normalize = do_normalize
        self.image_mean = list(image_mean if image_mean is not None else OPENAI_CLIP_MEAN)
        self.image_std = list(image_std if image_std is not None else OPENAI_CLIP_STD)
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        self.merge_size = merge_size

    def preprocess(self, videos: Any, **kwargs: Any):  # -> transformers.BatchFeature
        """Process one video or a batch of them; per-call keyword arguments override the
        instance's settings (`size`, `min_pixels`, `max_pixels`, `do_rescale`, `do_normalize`,
        ...). `video_metadata` (one per video) is passed through to the output's
        `video_metadata`; without it each video gets fps 24 with every frame sampled."""
        from transformers import BatchFeature

        opts = {
            key: kwargs[key] if kwargs.get(key) is not None else getattr(self, key)
            for key in SETTINGS
        }
        size = _edges(kwargs.get("size") or self.size)
        if kwargs.get("min_pixels") is not None:
            size["shortest_edge"] = kwargs["min_pixels"]
        if kwargs.get("max_pixels") is not None:
            size["longest_edge"] = kwargs["max_pixels"]

        all_patches, grids = [], []
        batch = [np.asarray(video) for video in make_batched_videos(videos)]
        metadata = _metadata(kwargs.get("video_metadata"), batch)
        batch = self._sample(batch, metadata, kwargs)
        for video in batch:
            _check_video(video)
            height, width = video.shape[1:3]
            if opts["do_resize"]:
                height, width = self._resized(
                    len(video), height, width, size, opts["patch_size"] * opts["merge_size"]
                )
            frames = self._frames(video, height, width)
            if opts["do_rescale"]:
                frames = frames * np.float32(opts["rescale_factor"])
            if opts["do_normalize"]:
                mean = np.asarray(opts["image_mean"], dtype=np.float32)[:, None, None]
                std = np.asarray(opts["image_std"], dtype=np.float32)[:, None, None]
                frames = (frames - mean) / std
            patches, grid = video_patches(
                frames, opts["patch_size"], opts["temporal_patch_size"], opts["merge_size"]
            )
            all_patches.append(patches)
            grids.append(grid)
        data = {
            "pixel_values_videos": np.concatenate(all_patches, axis=0),
            "video_grid_thw": np.asarray(grids, dtype=np.int64),
        }
        if kwargs.get("return_metadata"):
            data["video_metadata"] = metadata
        return BatchFeature(
            data,
            tensor_type=kwargs.get("return_tensors"),
            skip_tensor_conversion=["video_metadata"],
        )

    def _sample(
        self, batch: list[np.ndarray], metadata: list[VideoMetadata], kwargs: dict[str, Any]
    ) -> list[np.ndarray]:
        """The frames each video is processed with: all of them (Qwen2-VL's processor takes
        the frames it is given)."""
        if kwargs.get("do_sample_frames"):
            raise ValueError(
                f"{type(self).__name__} does not sample frames: pass the frames to use "
                "(do_sample_frames=False)"
            )
        return batch

    def _resized(
        self, num_frames: int, height: int, width: int, size: dict[str, int], factor: int
    ) -> tuple[int, int]:
        """(height, width) every frame is resized to: each frame's area within the size's
        bounds, as the PIL image processor resizes an image."""
        return smart_resize(
            height,
            width,
            factor=factor,
            min_pixels=size["shortest_edge"],
            max_pixels=size["longest_edge"],
        )

    @staticmethod
    def _frames(video: np.ndarray, height: int, width: int) -> np.ndarray:
        """(T, H, W, 3) uint8 -> (T, 3, height, width) float32, resized like the PIL image
        processor (bicubic)."""
        frames = []
        for frame in video:
            image = Image.fromarray(np.asarray(frame, dtype=np.uint8).squeeze()).convert("RGB")
            if image.size != (width, height):
                image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
            frames.append(np.asarray(image, dtype=np.float32).transpose(2, 0, 1))
        return np.stack(frames)

    def get_num_of_video_patches(
        self, num_frames: int, height: int, width: int, videos_kwargs: dict | None = None
    ) -> int:
        """The number of patches (before merging) a video of this size becomes."""
        kwargs = videos_kwargs or {}
        size = _edges(kwargs.get("size") or self.size)
        factor = self.patch_size * self.merge_size
        height, width = self._resized(num_frames, height, width, size, factor)
        grid_t = -(-num_frames // self.temporal_patch_size)
        return grid_t * (height // self.patch_size) * (width // self.patch_size)


class NumpyQwen3VLVideoProcessor(NumpyQwen2VLVideoProcessor):
    """Qwen3-VL's video processor (`Qwen3VLVideoProcessor`, torchvision only) in numpy and PIL,
    with its settings' meanings: frames are sampled `fps` a second of the clip (at least
    `min_frames`, at most `max_frames`, never more than the clip has) unless
    `do_sample_frames` is off, and the sampled indices go into the returned metadata, from
    which the Qwen3-VL processor writes each time step's timestamp; every frame of a clip is
    resized to one size whose area summed over the clip's frames lies within the size's bounds
    (Qwen2-VL bounds one frame). Frames are resized with PIL's bicubic filter, where the
    upstream processor uses torchvision's: the pixels differ by interpolation rounding, the
    same for every role, since all of them take the feeder's output (vLLM runs this same
    class)."""

    def __init__(
        self,
        *,
        fps: float = 2.0,
        min_frames: int = 4,
        max_frames: int = 768,
        do_sample_frames: bool = True,
        **kwargs: Any,
    ) -> None:
        for unused in ("num_frames", "cap_pixels_per_frame", "max_video_tokens", "resample"):
            kwargs.pop(unused, None)
        kwargs.setdefault("size", {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768})
        kwargs.setdefault("image_mean", [0.5] * 3)
        kwargs.setdefault("image_std", [0.5] * 3)
        kwargs.setdefault("patch_size", 16)
        super().__init__(**kwargs)
        self.fps = fps
        self.min_frames = min_frames
        self.max_frames = max_frames
        self.do_sample_frames = do_sample_frames

    def _sample(
        self, batch: list[np.ndarray], metadata: list[VideoMetadata], kwargs: dict[str, Any]
    ) -> list[np.ndarray]:
        sample = kwargs.get("do_sample_frames")
        if not (self.do_sample_frames if sample is None else sample):
            return batch
        out = []
        for video, meta in zip(batch, metadata, strict=True):
            meta.total_num_frames = len(video)
            indices = self.sample_frames(meta, fps=kwargs.get("fps"))
            meta.frames_indices = indices.tolist()
            out.append(video[indices])
        return out

    def sample_frames(self, metadata: VideoMetadata, fps: float | None = None) -> np.ndarray:
        """Indices of the frames a clip (`metadata`: its frame count and rate, 24 if unknown)
        is sampled to: `fps` (default the processor's) frames a second, at least `min_frames`
        and at most `max_frames`, never more than it has, evenly spread."""
        total = metadata.total_num_frames
        rate = metadata.fps if metadata.fps is not None else 24.0
        wanted = int(total / rate * (fps or self.fps))
        wanted = min(max(wanted, self.min_frames), self.max_frames, total)
        return np.linspace(0, total - 1, wanted).round().astype(int)

    def _resized(
        self, num_frames: int, height: int, width: int, size: dict[str, int], factor: int
    ) -> tuple[int, int]:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as clip

        return clip(
            num_frames=num_frames,
            height=height,
            width=width,
            temporal_factor=self.temporal_patch_size,
            factor=factor,
            min_pixels=size["shortest_edge"],
            max_pixels=size["longest_edge"],
        )


def _check_video(video: np.ndarray) -> None:
    if video.ndim != 4 or video.shape[-1] not in (1, 3):
        raise ValueError(
            f"a video must be (T, H, W, 3) or a list of HxWx3 frames, got shape {video.shape}"
        )


def video_patches(
    frames_tchw: np.ndarray, patch_size: int, temporal_patch_size: int, merge_size: int
) -> tuple[np.ndarray, list[int]]:
    """Cut (T, C, H, W) frames into Qwen-VL patches: (grid_t * grid_h * grid_w, C * temporal
    * patch * patch) and the grid [grid_t, grid_h, grid_w]. The last frame repeats up to a
    multiple of `temporal_patch_size`. Rows go time step by time step, and within one in
    merge_size x merge_size blocks (the tokens merged into one); each row is channel-major, then
    time, then pixel row and column (the vision tower's Conv3d weight layout)."""
    num_frames, channels, height, width = frames_tchw.shape
    if pad := -num_frames % temporal_patch_size:
        frames_tchw = np.concatenate([frames_tchw, np.repeat(frames_tchw[-1:], pad, axis=0)])
        num_frames += pad
    grid_t = num_frames // temporal_patch_size
    grid_h, grid_w = height // patch_size, width // patch_size
    blocks = frames_tchw.reshape(
        grid_t,
        temporal_patch_size,
        channels,
        grid_h // merge_size,
        merge_size,
        patch_size,
        grid_w // merge_size,
        merge_size,
        patch_size,
    )
    # -> (t, block row, block col, row in block, col in block, C, dt, ph, pw)
    blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    patches = blocks.reshape(
        grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size * patch_size
    )
    return np.ascontiguousarray(patches, dtype=np.float32), [grid_t, grid_h, grid_w]


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 1003520
) -> tuple[int, int]:
    """Qwen-VL's resize rule (the PIL image processor's own function): both sides multiples of
    `factor`, area within [min_pixels, max_pixels], aspect ratio kept as well as it can be."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        smart_resize as qwen_smart_resize,
    )

    return qwen_smart_resize(
        height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels
    )


def _edges(size: Any) -> dict[str, int]:
    """`size` (a dict or transformers' `SizeDict`) as {"shortest_edge", "longest_edge"} in
    pixels of area, the Qwen-VL meaning of the two."""
    get = size.get if isinstance(size, dict) else lambda key: getattr(size, key, None)
    edges = {"shortest_edge": get("shortest_edge"), "longest_edge": get("longest_edge")}
    if None in edges.values():
        raise ValueError(f"size must give shortest_edge and longest_edge (pixels), got {size}")
    return edges


def _metadata(given: Any, videos: list[np.ndarray]) -> list[VideoMetadata]:
    """One `VideoMetadata` per video: the given ones (dicts or objects), else fps 24; every
    frame is a sampled one unless `frames_indices` say otherwise."""
    if given is None:
        given = [None] * len(videos)
    elif isinstance(given, (dict, VideoMetadata)):
        given = [given]
    else:  # nested per prompt as the videos may be (vLLM's calls): flat, as they are made
        given = [m for entry in given for m in (entry if isinstance(entry, list) else [entry])]
    if len(given) != len(videos):
        raise ValueError(f"got {len(given)} video_metadata entries for {len(videos)} videos")
    out = []
    for meta, video in zip(given, videos, strict=True):
        if meta is None:
            meta = {"total_num_frames": len(video), "fps": 24.0}
        if isinstance(meta, dict):
            meta = VideoMetadata(**{k: v for k, v in meta.items() if k != "do_sample_frames"})
        if meta.frames_indices is None:  # every frame is used (Qwen3-VL times each from these)
            meta.frames_indices = list(range(len(video)))
        out.append(meta)
    return out


def install_transformers_shims() -> None:
    """Make `Qwen2_5_VLProcessor` constructible and loadable without torchvision (see the
    module docstring); idempotent, and a no-op where torchvision is installed."""
    if is_torchvision_available():
        return
    import transformers
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig
    from transformers.models.auto.video_processing_auto import (
        VIDEO_PROCESSOR_MAPPING,
        AutoVideoProcessor,
    )

    if "VideoProcessorMixin" not in vars(transformers):
        transformers.VideoProcessorMixin = VideoProcessorMixin
    for config_class, ours, upstream in (
        (Qwen2_5_VLConfig, NumpyQwen2VLVideoProcessor, "Qwen2VLVideoProcessor"),
        (Qwen3VLConfig, NumpyQwen3VLVideoProcessor, "Qwen3VLVideoProcessor"),
    ):
        registered = VIDEO_PROCESSOR_MAPPING._extra_content.get(config_class) or {}
        if registered.get("torchvision") is not ours:
            # The upstream class's name beside ours: a model directory saved with the
            # upstream processor names it, and the lookup then finds this entry.
            AutoVideoProcessor.register(
                config_class,
                video_processor_classes={"torchvision": ours, "upstream": upstream},
                exist_ok=True,
            )


def install_vllm_shims() -> None:
    """Call before vLLM loads a Qwen-VL model: the transformers shims plus a stand-in for the
    torchvision-only module vLLM takes `smart_resize` from; idempotent."""
    install_transformers_shims()
    if is_torchvision_available() or _VLLM_SHIMS_INSTALLED:
        return
    if QWEN_VL_IMAGE_MODULE not in sys.modules:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

        stand_in = types.ModuleType(
            QWEN_VL_IMAGE_MODULE,
            "Stand-in installed by streamrl.models.processors (torchvision is missing): only "
            "`smart_resize`, taken from the PIL image processor module.",
        )
        stand_in.smart_resize = pil.smart_resize
        sys.modules[QWEN_VL_IMAGE_MODULE] = stand_in
    # vLLM inspects a lazily registered architecture by importing it in a fresh subprocess,
    # which would not have the stand-in: register the class imported here instead.
    from vllm import ModelRegistry
    from vllm.model_executor.models.qwen2_5_omni_thinker import (
        Qwen2_5OmniThinkerForConditionalGeneration,
    )
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration

    ModelRegistry.register_model(
        "Qwen2_5_VLForConditionalGeneration", Qwen2_5_VLForConditionalGeneration
    )
    ModelRegistry.register_model("Qwen3VLForConditionalGeneration", Qwen3VLForConditionalGeneration)
    # A Qwen2.5-Omni directory names the whole model's class; vLLM runs its thinker.
    ModelRegistry.register_model(
        "Qwen2_5OmniForConditionalGeneration", Qwen2_5OmniThinkerForConditionalGeneration
    )
    globals()["_VLLM_SHIMS_INSTALLED"] = True


def processor_family(family: str) -> tuple[int, float | None]:
    """(patch size, every channel's mean and std; None: CLIP's) of a tiny model family's
    processor; an unknown family is an error naming the known ones."""
    if family not in PROCESSOR_FAMILIES:
        raise ValueError(f"family must be one of {sorted(PROCESSOR_FAMILIES)}, got {family!r}")
    return PROCESSOR_FAMILIES[family]


def vision_processors(
    min_pixels: int, max_pixels: int, *, family: str = "qwen2_5_vl"
) -> tuple[Any, Any]:
    """(image processor, video processor) of the tiny models: the PIL image processor and the
    numpy video processor of the family, with its patch size and mean/std, resizing images and
    frames to [min_pixels, max_pixels] (Qwen3-VL: up to `QWEN3_TINY_FRAMES` frames of that
    size; its own processor bounds a clip's pixels over all of its frames)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    install_transformers_shims()
    patch_size, mean_std = processor_family(family)
    normalise = (
        {} if mean_std is None else {"image_mean": [mean_std] * 3, "image_std": [mean_std] * 3}
    )
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size, **normalise
    )
    same = dict(
        patch_size=patch_size,
        image_mean=list(image_processor.image_mean),
        image_std=list(image_processor.image_std),
    )
    if family == "qwen3_vl":
        size = {"shortest_edge": min_pixels, "longest_edge": max_pixels * QWEN3_TINY_FRAMES}
        return image_processor, NumpyQwen3VLVideoProcessor(size=size, **same)
    video = NumpyQwen2VLVideoProcessor(min_pixels=min_pixels, max_pixels=max_pixels, **same)
    return image_processor, video


def build_processor(
    tokenizer: Any,
    *,
    min_pixels: int,
    max_pixels: int,
    chat_template: str | None = None,
    family: str = "qwen2_5_vl",
):  # -> transformers.Qwen2_5_VLProcessor | transformers.Qwen3VLProcessor
    """A Qwen2.5-VL (`family="qwen2_5_vl"`: 14-pixel patches, CLIP's mean/std) or Qwen3-VL
    (`"qwen3_vl"`: 16-pixel patches, mean and std 0.5) processor around `tokenizer`: the PIL
    image processor and the numpy video processor, both resizing to [min_pixels, max_pixels]."""
    from transformers import Qwen2_5_VLProcessor, Qwen3VLProcessor

    image_processor, video_processor = vision_processors(min_pixels, max_pixels, family=family)
    processor_class = Qwen3VLProcessor if family == "qwen3_vl" else Qwen2_5_VLProcessor
    return processor_class(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=chat_template if chat_template is not None else tokenizer.chat_template,
    )


def load_processor(model_dir: Path | str):  # -> transformers.Qwen2_5_VLProcessor
    """Load the processor saved in `model_dir` (local files only)."""
    from transformers import AutoProcessor

    install_transformers_shims()
    return AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
