"""Config sections of the training data: the built-in task or a data file (`DataConfig`), the
limits on a prompt's media (`MediaConfig`) and the warm start on a built-in task's noisy teacher
(`WarmStartConfig`). Re-exported by `streamrl.config.schema`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from streamrl.config.section import Section

# Built-in tasks whose prompts hold media: the built-in model is then a vision-language one
# (images, video), or a Qwen2.5-Omni thinker for audio.
VISION_TASKS = ("shapes", "motion")
AUDIO_TASKS = ("tones",)

# The rule a built-in task is scored by when `reward.function` is not set (the default,
# `arith_exact_match`, reads a number after the last colon).
TASK_REWARDS = {
    "motion": "streamrl.reward.rule:final_word_match",
    "tones": "streamrl.reward.rule:final_word_match",
}


class WarmStartConfig(Section):
    enabled: bool = True
    """Run a short supervised warm start (cached by its settings) before RL."""
    steps: int = Field(800, ge=0)
    """Optimizer steps of the warm start."""
    batch_size: int = Field(64, ge=1)
    """Examples per warm-start step."""
    lr: float = Field(3e-3, gt=0)
    """Warm-start learning rate (AdamW, cosine decay)."""
    teacher_forget_carry: float = Field(0.7, ge=0, le=1)
    """Fraction of warm-start answers in which the noisy teacher forgets every carry."""
    teacher_tool_use: float = Field(0.6, ge=0, le=1)
    """Calculator task: fraction of the teacher's answers that call the tool (the others are
    guesses)."""
    teacher_miscopy: float = Field(0.7, ge=0, le=1)
    """Calculator task: fraction of the teacher's tool answers that copy the result without
    its last digit."""
    teacher_miscount: float = Field(0.8, ge=0, le=1)
    """Shapes task: fraction of the teacher's answers that count one shape fewer than they
    write down."""
    teacher_reverse: float = Field(0.8, ge=0, le=1)
    """Motion task: fraction of the teacher's answers that name the direction opposite to the
    square's."""
    teacher_ear: float = Field(4.0, ge=1)
    """Tones task: two pitches less than this factor apart sound alike to the teacher, which
    then names the first tone in 80% of its answers (the right one in the rest)."""


class MediaConfig(Section):
    """Limits on the images, videos and audio of one prompt (docs/multimodal.md)."""

    max_pixels: int = Field(1280 * 28 * 28, ge=28 * 28)
    """Pixels of an image or of one video frame; larger ones are shrunk (aspect kept), and one
    over 64 times this is refused unread."""
    max_frames: int = Field(64, ge=1)
    """Frames of a video; a longer one is refused (sample it at a lower rate)."""
    max_audio_seconds: float = Field(30.0, gt=0)
    """Seconds of an audio clip; a longer one is refused."""
    max_media: int = Field(8, ge=1)
    """Images, videos and audio clips of one prompt together."""
    video_fps: float = Field(2.0, gt=0)
    """Frame rate of a video that does not say its own (frame files, a .npy array); an
    animated GIF's frame duration and a container's rate are read from the file."""
    store_dir: str | None = None
    """Folder of the preprocessed-media store, where each prompt's media is kept once processed
    (a safetensors file per prompt); None: `<run.cache_dir>/media`. Runs that share it process
    a prompt once between them; give it a disk with room for the data set's processed media."""
    store_max_gb: float | None = Field(None, gt=0)
    """Size limit of the media store in GB; past it, the entries used longest ago are deleted
    (and processed again if a later batch needs them). None: no limit."""
    store_keep_min: float = Field(60.0, ge=0)
    """With `store_max_gb`: entries used within this many minutes are never deleted. Rows on
    the bus, and rows a trainer keeps to recover in place, read their entries by key: keep it
    above the time from a batch's preparation to its last use (a few steps, up to a checkpoint
    interval with in-place recovery)."""


class DataConfig(Section):
    task: Literal["arith", "calculator", "shapes", "motion", "tones"] = "arith"
    """Built-in task (used when `train_file` is not set): `arith` (addition with a worked
    solution), `calculator` (products the model answers with a `calculate` tool; an agent
    task, `examples/agent_calculator.yaml`), `shapes` (counting coloured shapes in a generated
    picture; a vision task for the built-in vision-language model, `examples/vision.yaml`),
    `motion` (which way a square moves in a generated 2-frame clip; a video task,
    `examples/video.yaml`) or `tones` (which of two generated tones is higher; an audio task
    for the built-in Qwen2.5-Omni thinker, `examples/audio.yaml`). `motion` and `tones` are
    scored by `streamrl.reward.rule:final_word_match` unless `reward.function` is set."""
    digits: int = Field(2, ge=1, le=6)
    """Built-in task: operands have up to this many digits."""
    train_file: str | None = None
    """File of {"prompt", "answer"} rows: JSON lines (.jsonl, .json), a JSON array (.json),
    Parquet, CSV / TSV with a header row, a `datasets` folder from save_to_disk, or a folder or
    glob pattern of such files (a folder holding more than one split is refused); None uses the
    built-in task."""
    eval_file: str | None = None
    """File of held-out rows, as `train_file`. None: with `train_file`, rows held out from it
    (min(num_eval, a tenth of it), picked by `seed`); else the built-in task's held-out split."""
    prompt_key: str = "prompt"
    """Key of a row's prompt in the data files (dotted into nested records: `a.b`)."""
    answer_key: str = "answer"
    """Key of a row's reference answer (veRL's Parquet files: `reward_model.ground_truth`)."""
    num_eval: int = Field(256, ge=1)
    """Held-out prompts scored by greedy decoding at each evaluation."""
    seed: int = 0
    """Seed of prompt order and of the built-in task's problems."""
    chat_template: bool = True
    """Encode each prompt as a one-turn user message through the tokenizer's chat template,
    with the assistant turn opened; false feeds the prompt text as it is (base models without
    a chat template: write the format you want into the prompts, or `prompt_template`)."""
    prompt_template: str | None = None
    """A format for every prompt's text, with `{prompt}` where the text goes (a conversation's
    last user message); for example an R1-Zero style instruction around the question for a
    base model with chat_template=false. Other braces are kept as they are."""
    system_prompt: str | None = None
    """A system message put before every prompt (through the chat template, so not with
    chat_template=false); a conversation with a system message of its own keeps that one."""
    media: MediaConfig = MediaConfig()
    """Limits on the media of a prompt (images, videos, audio)."""

    @model_validator(mode="after")
    def _check_formats(self) -> DataConfig:
        if self.prompt_template is not None and "{prompt}" not in self.prompt_template:
            raise ValueError("prompt_template needs '{prompt}' where each prompt's text goes")
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError(
                "system_prompt needs chat_template=true (a system message is a chat turn); "
                "without a chat template, put it into prompt_template"
            )
        return self
