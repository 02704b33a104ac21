"""A multimodal prompt made ready for every role: decoded, processed, stored, counted.

`prepare_prompt` is the one place media meet the model's processor. It decodes the prompt's media
within the limits (`streamrl.media.load`), renders the conversation through the processor's chat
template and runs the processor, which expands each medium's placeholder into as many tokens as
the medium has patches (or audio frames). The prompt's token ids go on the bus; the processor's
tensors and the decoded media go to the `MediaCache` under the returned key. Engines and the
trainer read them back with `load_prepared`, so the processor runs once per prompt, before any
engine or the trainer needs it, and both sides see the same tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from streamrl.api import fields as F
from streamrl.media.cache import MediaCache, open_cache
from streamrl.media.load import MediaLimits, load_media, video_fps
from streamrl.media.refs import MEDIA_KINDS, MediaError, MultimodalPrompt

log = logging.getLogger(__name__)

PROMPT_IDS = "input_ids"  # the entry's name for the expanded prompt
MEDIA_PREFIX = "media."  # decoded media: "media.<i>.<kind>"
# The processor's keyword for each kind's list of media.
# What an entry holds changed (2: videos' frame rates and sampled frames): older entries are
# not read back, their prompts are processed again.
ENTRY_FORMAT = 2
VIDEO_FPS = "video_fps"  # each video's frame rate, beside the processor's tensors
VIDEO_FRAMES = "video_frames"  # the indices of the frames each video was sampled to, all videos'
PROCESSOR_ARGS = {"image": "images", "video": "videos", "audio": "audio"}
# Processor attributes naming the placeholder token of each kind, where a processor has one.
PLACEHOLDER_ATTRS = {"image": "image_token", "video": "video_token", "audio": "audio_token"}


@dataclass(frozen=True)
class PreparedPrompt:
    """A processed multimodal prompt: its ids (placeholders expanded), its cache key, and what
    the run's metrics count (media per kind, placeholder tokens, seconds spent; 0 when cached)."""

    prompt_ids: np.ndarray
    media_key: str
    counts: dict[str, int] = field(default_factory=dict)
    num_media_tokens: int = 0
    seconds: float = 0.0


def processor_fingerprint(processor) -> str:
    """A digest of everything in the processor that changes its output."""
    parts = {}
    for name in ("image_processor", "video_processor", "feature_extractor"):
        sub = getattr(processor, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            parts[name] = sub.to_dict()
    tokenizer = getattr(processor, "tokenizer", processor)
    parts["chat_template"] = getattr(processor, "chat_template", None) or getattr(
        tokenizer, "chat_template", None
    )
    parts["vocab"] = len(tokenizer)
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def media_key(prompt: MultimodalPrompt, fingerprint: str, limits: MediaLimits) -> str:
    """The cache key of `prompt`: its conversation, its media's content, the processor, the
    limits."""
    h = hashlib.sha256(f"{ENTRY_FORMAT}:{fingerprint}".encode())
    h.update(json.dumps(prompt.messages, sort_keys=True).encode())
    h.update(repr(limits).encode())
    for ref in prompt.media:
        h.update(ref.digest().encode())
    return h.hexdigest()


def prepare_prompt(
    prompt: MultimodalPrompt,
    processor,
    cache: MediaCache,
    *,
    limits: MediaLimits,
    fingerprint: str | None = None,
) -> PreparedPrompt:
    """Decode, process and store `prompt` (module docstring); a `MediaError` says which medium
    failed and why (the caller names the row)."""
    if len(prompt.media) > limits.max_media:
        raise MediaError(
            "too_many_media",
            f"the prompt has {len(prompt.media)} media, over data.media.max_media="
            f"{limits.max_media}",
        )
    key = media_key(prompt, fingerprint or processor_fingerprint(processor), limits)
    counts = {kind: prompt.count(kind) for kind in MEDIA_KINDS if prompt.count(kind)}
    entry = cache.get(key)
    start = time.perf_counter()
    if entry is None:
        entry = _process(prompt, processor, limits)
        cache.put(key, entry)
        seconds = time.perf_counter() - start
    else:
        seconds = 0.0
    ids = entry[PROMPT_IDS].numpy().astype(np.int64)
    placeholders = placeholder_ids(processor)
    return PreparedPrompt(
        prompt_ids=ids,
        media_key=key,
        counts=counts,
        num_media_tokens=int(np.isin(ids, list(placeholders.values())).sum()),
        seconds=seconds,
    )


def _process(prompt: MultimodalPrompt, processor, limits: MediaLimits) -> dict[str, torch.Tensor]:
    decoded = [load_media(ref, limits) for ref in prompt.media]
    text = processor.apply_chat_template(
        prompt.messages, tokenize=False, add_generation_prompt=True
    )
    kwargs = {}
    for kind, arg in PROCESSOR_ARGS.items():
        items = [m for m, ref in zip(decoded, prompt.media, strict=True) if ref.kind == kind]
        if items:
            kwargs[arg] = items
    if "audio" in kwargs:
        if "audio" not in placeholder_ids(processor):
            # A processor without audio (Qwen-VL's) would drop the clip without a word.
            raise MediaError(
                "unsupported",
                f"{type(processor).__name__} takes no audio (it has no audio placeholder "
                "token): audio prompts need an audio policy, such as a Qwen2.5-Omni model",
            )
        kwargs["sampling_rate"] = limits.audio_rate
        kwargs.update(_short_audio_padding(processor, kwargs["audio"]))
    if "videos" in kwargs:
        # Frames sampled here, once (a processor that samples, as Qwen3-VL's, is asked which),
        # so every engine takes the very frames the processor took; the real frame rate and the
        # frames' indices time the video's positions (Qwen3-VL: its timestamps in the text).
        videos = [i for i, ref in enumerate(prompt.media) if ref.kind == "video"]
        rates = [video_fps(prompt.media[i], limits) for i in videos]
        totals = [len(decoded[i]) for i in videos]
        chosen = [
            _sampled_frames(processor, total, fps) for total, fps in zip(totals, rates, strict=True)
        ]
        for i, frames in zip(videos, chosen, strict=True):
            decoded[i] = decoded[i][frames]
        kwargs["videos"] = [decoded[i] for i in videos]
        kwargs["video_metadata"] = [
            {"fps": fps, "total_num_frames": total, "frames_indices": frames.tolist()}
            for fps, total, frames in zip(rates, totals, chosen, strict=True)
        ]
        kwargs["do_sample_frames"] = False
    outputs = processor(text=[text], return_tensors="pt", **kwargs)
    entry = {PROMPT_IDS: outputs["input_ids"][0]}
    if "videos" in kwargs:  # for an engine that processes the frames again: float64, as the
        # processor computed the timestamps with them
        entry[VIDEO_FPS] = torch.tensor(rates, dtype=torch.float64)
        entry[VIDEO_FRAMES] = torch.from_numpy(np.concatenate(chosen))
    for name, value in outputs.items():
        # Per-token types and masks are the batch's to build (padding moves the tokens).
        per_token = ("input_ids", "attention_mask", "mm_token_type_ids")
        if name not in per_token and isinstance(value, torch.Tensor):
            entry[name] = value
    if "feature_attention_mask" in entry:
        # Audio features come padded to the feature extractor's 30 s; the towers read only the
        # masked frames, so the padding is left out (1.5 MB a clip otherwise). The kept frames
        # are those of the padded computation, exactly what an engine computes from the audio.
        frames = int(entry["feature_attention_mask"].sum(-1).max())
        entry["input_features"] = entry["input_features"][..., :frames].contiguous()
        entry["feature_attention_mask"] = entry["feature_attention_mask"][:, :frames].contiguous()
    for i, (medium, ref) in enumerate(zip(decoded, prompt.media, strict=True)):
        entry[f"{MEDIA_PREFIX}{i}.{ref.kind}"] = torch.from_numpy(np.array(medium))
    return entry


def _sampled_frames(processor, num_frames: int, fps: float) -> np.ndarray:
    """Indices of the frames of a `num_frames` clip at `fps` the processor's video processor
    takes: those its `sample_frames` picks where it samples (`do_sample_frames`), else all."""
    from transformers.video_utils import VideoMetadata

    video = getattr(processor, "video_processor", None)
    if getattr(video, "do_sample_frames", False) and hasattr(video, "sample_frames"):
        metadata = VideoMetadata(total_num_frames=num_frames, fps=fps)
        return np.asarray(video.sample_frames(metadata), dtype=np.int64)
    return np.arange(num_frames, dtype=np.int64)


def _short_audio_padding(processor, clips) -> dict[str, Any]:
    """Keyword arguments that let a Whisper feature extractor pad the clips to the longest one
    plus one STFT window instead of to its 30 s: the frames of the clips come out bit for bit
    the same (their windows see the same zeros past the end, and the log-mel floor comes from
    the loudest frame), at a tenth of the cost for a 1 s clip."""
    extractor = getattr(processor, "feature_extractor", None)
    if not all(hasattr(extractor, a) for a in ("n_fft", "hop_length", "n_samples")):
        return {}
    hop = extractor.hop_length
    longest = max(len(clip) for clip in clips) + extractor.n_fft + hop
    return {"audio_kwargs": {"max_length": min(extractor.n_samples, -(-longest // hop) * hop)}}


def load_prepared(cache: MediaCache, key: str) -> tuple[dict[str, torch.Tensor], list]:
    """The processor's tensors (model inputs beside the ids) and the decoded media, in prompt
    order as `(kind, array)`, of the entry `key`; a missing entry is an error naming the key."""
    entry = cache.get(key)
    if entry is None:
        raise KeyError(
            f"no preprocessed media under key {key[:16]}... in the media cache: the feeder "
            "writes them before the row reaches the bus"
        )
    inputs = {
        name: t for name, t in entry.items() if name != PROMPT_IDS and MEDIA_PREFIX not in name
    }
    media = sorted(
        (int(name.split(".")[1]), name.split(".")[2], t.numpy())
        for name, t in entry.items()
        if name.startswith(MEDIA_PREFIX)
    )
    return inputs, [(kind, array) for _, kind, array in media]


def bus_value(prepared: PreparedPrompt, cache: MediaCache) -> dict[str, str]:
    """What a row's `media` field holds: the entry's key and the store's folder, so any role of
    the run (in any process that sees the folder) reads the tensors back (`row_media`)."""
    assert cache.root is not None, "a run's media store lives on disk"
    return {"key": prepared.media_key, "store": str(cache.root)}


def row_media(rows) -> list[dict[str, Any] | None] | None:
    """Per row, its prompt's media as a forward or an engine takes them (the processor's
    tensors, `key`, and `decoded`: the media as `(kind, array)`), None for a text row; None when
    the rows carry no `media` field (a text-only model's run)."""
    if not rows or F.MEDIA not in rows[0]:
        return None
    out = []
    for row in rows:
        value = row.get(F.MEDIA)
        if not value:
            out.append(None)
            continue
        inputs, decoded = load_prepared(open_cache(value["store"]), value["key"])
        out.append({**inputs, "key": value["key"], "decoded": decoded})
    return out


def placeholder_ids(processor) -> dict[str, int]:
    """The token id of each kind's placeholder the processor expands."""
    tokenizer = getattr(processor, "tokenizer", processor)
    out = {}
    for kind, attr in PLACEHOLDER_ATTRS.items():
        token = getattr(processor, attr, None)
        if isinstance(token, str):
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is not None and token_id != tokenizer.unk_token_id:
                out[kind] = int(token_id)
    return out


class MediaPreparer:
    """A run's prompt preparation: the policy's processor, the media store and the limits, and
    what it has done (prompts, media, seconds, rows dropped by reason) for the run's metrics."""

    def __init__(self, processor, cache: MediaCache, limits: MediaLimits):
        self.processor, self.cache, self.limits = processor, cache, limits
        self.fingerprint = processor_fingerprint(processor)
        self.num_prompts = 0
        self.num_media_tokens = 0
        self.seconds = 0.0
        self.num_media: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()

    def prepare(self, prompt: MultimodalPrompt, row: str) -> PreparedPrompt | None:
        """`prompt` prepared (`prepare_prompt`), or None when a medium is bad: then the row
        (named `row` in the warning) is counted under the reason."""
        try:
            prepared = prepare_prompt(
                prompt, self.processor, self.cache, limits=self.limits, fingerprint=self.fingerprint
            )
        except MediaError as e:
            self.dropped[e.reason] += 1
            log.warning("%s; the row is left out", e.for_row(row))
            return None
        self.num_prompts += 1
        self.num_media_tokens += prepared.num_media_tokens
        self.seconds += prepared.seconds
        self.num_media.update(prepared.counts)
        return prepared

    def bus_value(self, prepared: PreparedPrompt) -> dict[str, str]:
        """The row's `media` field for `prepared` (`bus_value` with this run's store)."""
        return bus_value(prepared, self.cache)

    def metrics(self) -> dict[str, float]:
        """Cumulative counts (the run's tracker turns them into per-step figures)."""
        out = {
            "media/prompts": float(self.num_prompts),
            "media/tokens_per_prompt": self.num_media_tokens / max(self.num_prompts, 1),
            "media/preprocess_s": self.seconds,
        }
        if self.cache.max_bytes is not None:
            out["media/store_evicted"] = float(self.cache.evicted)
        out.update({f"media/{kind}s": float(n) for kind, n in self.num_media.items()})
        out.update({f"media/dropped_{reason}": float(n) for reason, n in self.dropped.items()})
        return out
