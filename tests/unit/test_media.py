"""Media in prompts: the three row layouts, decoding within limits, bad media, the store."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from streamrl.media.cache import MediaCache
from streamrl.media.load import (
    MediaLimits,
    encode_wav,
    load_audio,
    load_image,
    load_media,
    load_video,
    video_fps,
)
from streamrl.media.refs import MediaError, MediaRef, extract_media, has_media, to_ref


def _png(path, size=(32, 24), color=(255, 0, 0)):
    Image.new("RGB", size, color).save(path)
    return str(path)


def _wav(path, *, rate=16000, seconds=0.5, freq=440.0, channels=1):
    t = np.arange(int(rate * seconds)) / rate
    Path(path).write_bytes(encode_wav(0.5 * np.sin(2 * np.pi * freq * t), rate, channels))
    return str(path)


# --- row layouts ---------------------------------------------------------------------------


def test_chat_parts_keep_media_in_place(tmp_path):
    a, b = _png(tmp_path / "a.png"), _png(tmp_path / "b.png")
    prompt = [
        {"role": "system", "content": "Count."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Left:"},
                {"type": "image", "image": "a.png"},
                {"type": "text", "text": "Right:"},
                {"type": "image", "path": b},
            ],
        },
    ]
    out = extract_media({}, prompt, base_dir=tmp_path)
    assert [r.path for r in out.media] == [a, b]  # relative paths resolve against the data
    assert out.messages[1]["content"] == [
        {"type": "text", "text": "Left:"},
        {"type": "image"},
        {"type": "text", "text": "Right:"},
        {"type": "image"},
    ]
    assert out.messages[0]["content"] == [{"type": "text", "text": "Count."}]


def test_verl_columns_follow_their_markers(tmp_path):
    a, v = _png(tmp_path / "a.png"), str(tmp_path / "v.npy")
    row = {"images": [{"image": a}], "videos": [v]}
    out = extract_media(row, "Watch <video> then look at <image>. Which?", base_dir=tmp_path)
    assert [(r.kind, r.path) for r in out.media] == [("video", v), ("image", a)]
    assert [p["type"] for p in out.messages[0]["content"]] == [
        "text",
        "video",
        "text",
        "image",
        "text",
    ]


def test_trl_image_column_goes_first_in_the_first_user_turn(tmp_path):
    a = _png(tmp_path / "a.png")
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "How many?"}]
    out = extract_media({"image": {"bytes": open(a, "rb").read(), "path": None}}, prompt)
    assert out.media[0].data is not None and out.media[0].kind == "image"
    assert out.messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "How many?"}]
    assert has_media({"image": a}, "x") and not has_media({}, "x")


def test_marker_count_mismatch_is_refused(tmp_path):
    a = _png(tmp_path / "a.png")
    with pytest.raises(MediaError) as err:
        extract_media({"images": [a]}, "<image> and <image>")
    assert err.value.reason == "mismatch"
    with pytest.raises(MediaError) as err:
        extract_media({"images": [a, a]}, "only <image>")
    assert err.value.reason == "mismatch" and "fewer <image> markers" in str(err.value)


def test_urls_are_refused_and_data_urls_read(tmp_path):
    with pytest.raises(MediaError, match="downloaded") as err:
        to_ref("image", "https://example.com/cat.png")
    assert err.value.reason == "unsupported"
    payload = open(_png(tmp_path / "a.png"), "rb").read()
    url = "data:image/png;base64," + base64.b64encode(payload).decode()
    assert to_ref("image", url).data == payload
    assert to_ref("image", f"file://{tmp_path}/a.png").path == f"{tmp_path}/a.png"


def test_digest_follows_content_not_name(tmp_path):
    a = _png(tmp_path / "a.png")
    b = _png(tmp_path / "b.png")
    c = _png(tmp_path / "c.png", color=(0, 255, 0))
    assert to_ref("image", a).digest() == to_ref("image", b).digest()
    assert to_ref("image", a).digest() != to_ref("image", c).digest()
    with pytest.raises(MediaError) as err:
        to_ref("image", str(tmp_path / "gone.png")).digest()
    assert err.value.reason == "missing"


# --- decoding within limits ----------------------------------------------------------------


def test_image_is_shrunk_to_the_pixel_limit(tmp_path):
    ref = to_ref("image", _png(tmp_path / "big.png", size=(400, 100)))
    image = load_image(ref, MediaLimits(max_pixels=100 * 25))
    assert image.size == (100, 25) and image.mode == "RGB"
    assert load_image(ref, MediaLimits()).size == (400, 100)


def test_bad_images_say_why(tmp_path):
    corrupt = tmp_path / "bad.png"
    corrupt.write_bytes(b"\x89PNG not really")
    cases = {
        "missing": to_ref("image", str(tmp_path / "nope.png")),
        "corrupt": to_ref("image", str(corrupt)),
        "too_large": to_ref("image", _png(tmp_path / "huge.png", size=(800, 800))),
    }
    for reason, ref in cases.items():
        with pytest.raises(MediaError) as err:
            load_image(ref, MediaLimits(max_pixels=1000))
        assert err.value.reason == reason, (reason, err.value)
        assert ref.describe() in str(err.value)


def test_video_from_frames_gif_and_npy(tmp_path):
    frames = [_png(tmp_path / f"f{i}.png", color=(i * 50, 0, 0)) for i in range(4)]
    from_frames = load_video(MediaRef("video", frames=tuple(frames)), MediaLimits())
    assert from_frames.shape == (4, 24, 32, 3) and from_frames[3, 0, 0, 0] == 150
    gif = tmp_path / "v.gif"
    images = [Image.new("RGB", (16, 16), (0, 0, i * 60)) for i in range(3)]
    images[0].save(gif, save_all=True, append_images=images[1:], duration=100)
    assert load_video(to_ref("video", str(gif)), MediaLimits()).shape == (3, 16, 16, 3)
    npy = tmp_path / "v.npy"
    np.save(npy, np.zeros((5, 8, 8, 3), np.uint8))
    assert load_media(to_ref("video", str(npy)), MediaLimits()).shape == (5, 8, 8, 3)


def test_video_past_the_frame_limit_is_refused(tmp_path):
    npy = tmp_path / "long.npy"
    np.save(npy, np.zeros((9, 8, 8, 3), np.uint8))
    frames = tuple(_png(tmp_path / f"f{i}.png") for i in range(9))
    for ref in (to_ref("video", str(npy)), MediaRef("video", frames=frames)):
        with pytest.raises(MediaError, match="max_frames=8") as err:
            load_video(ref, MediaLimits(max_frames=8))
        assert err.value.reason == "too_many_frames"
    np.save(npy, np.zeros((2, 8, 8), np.float32))
    with pytest.raises(MediaError, match="uint8 array"):
        load_video(to_ref("video", str(npy)), MediaLimits())


def test_audio_reads_wav_and_refuses_wrong_rate_or_length(tmp_path):
    samples = load_audio(to_ref("audio", _wav(tmp_path / "a.wav", channels=2)), MediaLimits())
    assert samples.dtype == np.float32 and samples.shape == (8000,)
    assert 0.45 < float(np.abs(samples).max()) <= 0.5
    with pytest.raises(MediaError, match="8000 Hz") as err:
        load_audio(to_ref("audio", _wav(tmp_path / "b.wav", rate=8000)), MediaLimits())
    assert err.value.reason == "wrong_rate"
    with pytest.raises(MediaError) as err:
        load_audio(to_ref("audio", _wav(tmp_path / "c.wav", seconds=2)), MediaLimits(1, 1, 1.0))
    assert err.value.reason == "too_long"
    (tmp_path / "d.wav").write_bytes(b"RIFF....garbage")
    with pytest.raises(MediaError):
        load_audio(to_ref("audio", str(tmp_path / "d.wav")), MediaLimits())


def test_row_name_prefixes_the_message():
    err = MediaError("missing", "image x.png: no such file").for_row("data.jsonl line 7")
    assert str(err) == "data.jsonl line 7: image x.png: no such file" and err.reason == "missing"


# --- the store -----------------------------------------------------------------------------


def test_cache_round_trip_on_disk_and_in_memory(tmp_path):
    entry = {"input_ids": torch.arange(5), "pixel_values": torch.randn(4, 6)}
    cache = MediaCache(tmp_path, memory_entries=1)
    cache.put("ab12", entry)
    cache.put("cd34", {"x": torch.zeros(1)})  # evicts ab12 from memory
    again = MediaCache(tmp_path).get("ab12")  # another process: from disk
    assert torch.equal(again["pixel_values"], entry["pixel_values"])
    assert cache.get("ab12") is not None and cache.get("ef56") is None
    assert not list(tmp_path.rglob("*.tmp"))
    memory_only = MediaCache(None)
    memory_only.put("ab12", entry)
    assert torch.equal(memory_only.get("ab12")["input_ids"], torch.arange(5))


def _age(cache: MediaCache, key: str, seconds: float) -> None:
    """Make the entry `key` look last used `seconds` ago."""
    path = cache._path(key)
    then = path.stat().st_mtime - seconds
    os.utime(path, (then, then))


def test_a_store_over_its_limit_deletes_the_entries_used_longest_ago(tmp_path):
    entry = {"pixel_values": torch.zeros(1000)}  # 4,000 bytes of tensor, plus a header
    cache = MediaCache(tmp_path, memory_entries=1)
    for i, key in enumerate(["aa01", "bb02", "cc03"]):
        cache.put(key, entry)
        _age(cache, key, 3000 - 1000 * i)  # aa01 used longest ago
    size = cache._path("aa01").stat().st_size
    cache.get("aa01")  # a use: aa01 is now the most recent
    cache.limit(int(size * 3.5), min_age_s=600)
    cache.put("dd04", entry)  # four entries over a limit of 3.5: down to 0.9 * 3.5 = 3.15
    on_disk = {p.stem for p in tmp_path.rglob("*.safetensors")}
    assert on_disk == {"aa01", "cc03", "dd04"} and cache.evicted == 1
    assert cache.get("bb02") is None  # deleted: the feeder processes its prompt again


def test_entries_used_recently_are_kept_over_the_limit(tmp_path, caplog):
    entry = {"pixel_values": torch.zeros(1000)}
    cache = MediaCache(tmp_path, memory_entries=1)
    cache.limit(1, min_age_s=600)
    with caplog.at_level("WARNING"):
        for key in ["aa01", "bb02", "cc03"]:
            cache.put(key, entry)
    assert len(list(tmp_path.rglob("*.safetensors"))) == 3 and cache.evicted == 0
    assert "over its limit" in caplog.text
    # Written back from memory when another run's limit deleted it on disk.
    cache._path("cc03").unlink()
    assert cache.get("cc03") is not None and cache._path("cc03").is_file()


def test_the_runs_store_takes_its_folder_and_limit_from_the_config(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from streamrl.config.loader import load_config
    from streamrl.data.role import media_preparer
    from streamrl.models import processors

    monkeypatch.setattr(processors, "load_processor", lambda model_dir: [])  # no model needed
    store = tmp_path / "store"
    cfg = load_config(
        [
            "data.task=shapes",
            f"data.media.store_dir={store}",
            "data.media.store_max_gb=2.5",
            "data.media.store_keep_min=30",
        ]
    )
    preparer = media_preparer(SimpleNamespace(cfg=cfg, policy_dir=tmp_path))
    assert preparer.cache.root == store.resolve()
    assert (preparer.cache.max_bytes, preparer.cache.min_age_s) == (2_500_000_000, 1800.0)
    assert preparer.metrics()["media/store_evicted"] == 0.0


def test_wav_bytes_inline(tmp_path):
    buf = io.BytesIO(open(_wav(tmp_path / "a.wav"), "rb").read())
    assert load_audio(MediaRef("audio", data=buf.getvalue()), MediaLimits()).shape == (8000,)


def test_video_frame_rate_comes_from_the_file_or_the_default(tmp_path):
    gif = tmp_path / "v.gif"
    images = [Image.new("RGB", (16, 16), (0, 0, i * 60)) for i in range(3)]
    images[0].save(gif, save_all=True, append_images=images[1:], duration=250)
    assert video_fps(to_ref("video", str(gif)), MediaLimits()) == 4.0
    npy = tmp_path / "v.npy"
    np.save(npy, np.zeros((2, 8, 8, 3), np.uint8))
    assert video_fps(to_ref("video", str(npy)), MediaLimits(video_fps=3.0)) == 3.0
