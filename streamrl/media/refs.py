"""Where a dataset row keeps its images, videos and audio, read into one form.

Three layouts are in use, and a row may be in any of them:

- chat messages whose `content` is a list of parts: `{"type": "text", "text": ...}` and
  `{"type": "image" | "video" | "audio", <kind> | "path" | "url": ...}` (the media in place);
- veRL's columns `images` / `videos` / `audios`, lists matched in order to `<image>` /
  `<video>` / `<audio>` markers in the prompt's text (media with no marker go first);
- TRL's single `image` (or `images`) column beside a text or chat prompt, placed first in the
  first user message.

`extract_media` returns the conversation with every medium replaced by a bare part
(`{"type": "image"}`: what a processor's chat template expands into placeholder tokens) and the
media themselves as `MediaRef`s, in prompt order. A reference is a local path (relative paths
resolve against the dataset's folder), a `file://` or `data:` URL, encoded bytes (a `datasets`
Image column stores `{"bytes", "path"}`), or for a video a list of frame files. Anything that
would need the network is refused: nothing is downloaded at run time.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MEDIA_KINDS = ("image", "video", "audio")
# veRL's / TRL's column of each kind, and the marker that places an item in the prompt's text.
COLUMNS = {"image": ("images", "image"), "video": ("videos", "video"), "audio": ("audios", "audio")}
MARKER = re.compile(r"<(image|video|audio)>")


class MediaError(ValueError):
    """A medium that cannot be used, with `reason` a short word counted in the run's metrics
    (`missing`, `corrupt`, `unsupported`, `too_large`, `too_many_frames`, `too_long`,
    `wrong_rate`, `too_many_media`, `mismatch`) and a message that names the row."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason

    def for_row(self, row: str) -> MediaError:
        """The same error, its message prefixed with the row it came from."""
        return MediaError(self.reason, f"{row}: {self}")


@dataclass(frozen=True)
class MediaRef:
    """One image, video or audio clip of a prompt: a file (`path`), encoded bytes (`data`) or,
    for a video, its frames' files (`frames`)."""

    kind: str
    path: str | None = None
    data: bytes | None = None
    frames: tuple[str, ...] | None = None

    def describe(self) -> str:
        """How error messages name the medium."""
        if self.path is not None:
            return f"{self.kind} {self.path}"
        if self.frames is not None:
            return f"{self.kind} of {len(self.frames)} frames from {self.frames[0]}"
        return f"{self.kind} of {len(self.data or b'')} inline bytes"

    def digest(self) -> str:
        """A hash of the content (the file's bytes, not its name): equal media share a cache
        entry, and an edited file gets a new one."""
        h = hashlib.sha256(self.kind.encode())
        if self.data is not None:
            h.update(self.data)
        for path in self.frames or ((self.path,) if self.path is not None else ()):
            try:
                h.update(Path(path).read_bytes())
            except FileNotFoundError:
                raise MediaError("missing", f"{self.describe()}: no such file {path}") from None
            except OSError as e:
                raise MediaError("missing", f"cannot read {self.describe()}: {e}") from None
        return h.hexdigest()


@dataclass(frozen=True)
class MultimodalPrompt:
    """A conversation whose media parts are bare (`{"type": "image"}`), and its media in order."""

    messages: list[dict[str, Any]]
    media: tuple[MediaRef, ...]

    def count(self, kind: str) -> int:
        return sum(ref.kind == kind for ref in self.media)


def has_media(row: dict[str, Any], prompt: Any) -> bool:
    """Whether a dataset row carries any medium (a column or a media part in its messages)."""
    if any(row.get(col) not in (None, [], "") for cols in COLUMNS.values() for col in cols):
        return True
    return isinstance(prompt, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) for m in prompt
    )


def extract_media(
    row: dict[str, Any], prompt: Any, *, base_dir: Path | None = None
) -> MultimodalPrompt:
    """The row's conversation with its media taken out (module docstring); `prompt` is the
    row's prompt (a text or chat messages), `row` the rest of it (the media columns)."""
    messages = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
    )
    columns = {kind: _column(row, kind, base_dir) for kind in MEDIA_KINDS}
    out_messages, refs = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"prompt message {i} is not a chat message: {message!r}"[:300])
        parts = _parts(message.get("content"), i)
        content = []
        for part in parts:
            kind = part["type"]
            if kind == "text":
                content += _split_markers(part["text"], columns, refs)
            else:
                source = next((part[k] for k in (kind, "path", "url") if k in part), None)
                if source is None:
                    raise ValueError(f"prompt message {i} has a {kind} part with no {kind}/path")
                refs.append(to_ref(kind, source, base_dir))
                content.append({"type": kind})
        out_messages.append({"role": message["role"], "content": content})
    leftover = [ref for kind in MEDIA_KINDS for ref in columns[kind]]
    if leftover and any(ref in refs for ref in _column(row, leftover[0].kind, base_dir)):
        raise MediaError(
            "mismatch",
            f"the prompt has fewer <{leftover[0].kind}> markers than the row has "
            f"{leftover[0].kind}s: give every one a marker, or none (then they go first)",
        )
    if leftover:  # column media with no marker: first in the first user message
        first = next((m for m in out_messages if m["role"] == "user"), None)
        if first is None:
            raise ValueError("the row has media but its prompt has no user message")
        first["content"][:0] = [{"type": ref.kind} for ref in leftover]
        refs = _in_prompt_order(out_messages, refs + leftover, leftover)
    return MultimodalPrompt(out_messages, tuple(refs))


def _in_prompt_order(messages, refs, leftover):
    """`refs` reordered to the order of the media parts in `messages` (the leftovers went
    before every other part of the first user message)."""
    placed = [r for r in refs if all(r is not x for x in leftover)]
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    before = sum(
        part["type"] != "text"
        for m in messages[:first_user]
        for part in m["content"]  # media of earlier (system) messages come first
    )
    return placed[:before] + leftover + placed[before:]


def _parts(content: Any, index: int) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ValueError(f"prompt message {index}'s content must be a string or a list of parts")
    parts = []
    for part in content:
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", *MEDIA_KINDS):
            raise ValueError(
                f"prompt message {index} has a part {part!r} that is not text, image, video or "
                "audio"[:300]
            )
        parts.append(part)
    return parts


def _split_markers(text: str, columns: dict[str, list[MediaRef]], refs: list[MediaRef]):
    """Text parts and bare media parts for `text`, each `<kind>` marker taking the next item of
    that kind's column."""
    out, start = [], 0
    for match in MARKER.finditer(text):
        kind = match.group(1)
        if not columns[kind]:
            raise MediaError(
                "mismatch", f"the prompt has more <{kind}> markers than the row has {kind}s"
            )
        if match.start() > start:
            out.append({"type": "text", "text": text[start : match.start()]})
        refs.append(columns[kind].pop(0))
        out.append({"type": kind})
        start = match.end()
    if start < len(text) or not out:
        out.append({"type": "text", "text": text[start:]})
    return out


def _column(row: dict[str, Any], kind: str, base_dir: Path | None) -> list[MediaRef]:
    for name in COLUMNS[kind]:
        value = row.get(name)
        if value in (None, [], ""):
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        if kind == "video" and items and all(isinstance(x, str) for x in items) and name == kind:
            items = [list(items)]  # TRL-style `video`: one video given as its frame files
        return [to_ref(kind, item, base_dir) for item in items]
    return []


def to_ref(kind: str, source: Any, base_dir: Path | None = None) -> MediaRef:
    """A `MediaRef` for one medium as a row holds it (module docstring)."""
    if isinstance(source, dict):  # a `datasets` Image/Audio column, or veRL's {"image": path}
        if source.get("bytes") is not None:
            return MediaRef(kind, data=bytes(source["bytes"]))
        inner = next((source[k] for k in (kind, "path", "url") if source.get(k)), None)
        if inner is None:
            raise ValueError(f"a {kind} entry {str(source)[:120]} has no bytes, path or url")
        return to_ref(kind, inner, base_dir)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return MediaRef(kind, data=bytes(source))
    if isinstance(source, (list, tuple)):
        if kind != "video" or not source or not all(isinstance(f, str) for f in source):
            raise ValueError(f"a {kind} given as a list must be a video's frame files")
        return MediaRef(kind, frames=tuple(_local_path(f, base_dir) for f in source))
    if isinstance(source, str):
        if source.startswith("data:"):
            return MediaRef(kind, data=_data_url(source))
        return MediaRef(kind, path=_local_path(source, base_dir))
    raise ValueError(f"cannot read a {kind} from a {type(source).__name__}")


def _local_path(source: str, base_dir: Path | None) -> str:
    if source.startswith("file://"):
        source = source[len("file://") :]
    elif re.match(r"^[a-z][a-z0-9+.-]*://", source, re.IGNORECASE):
        raise MediaError(
            "unsupported",
            f"{source[:120]} is a URL: streamrl reads media from local files only (nothing is "
            "downloaded at run time); download it first and give its path",
        )
    path = Path(source).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return str(path)


def _data_url(url: str) -> bytes:
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ValueError(f"a data: URL must be base64 encoded, got {header[:60]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError as e:
        raise MediaError("corrupt", f"a data: URL is not valid base64: {e}") from None
