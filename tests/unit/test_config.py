"""Run configuration: defaults, YAML files and dotted overrides, error messages, `dump_yaml`, CLI."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from streamrl.cli import main, parse_command_line
from streamrl.config import Config, ConfigError, dump_yaml, load_config
from streamrl.config.presets import PRESETS


def sections() -> list[tuple[str, type[BaseModel]]]:
    return [(name, field.annotation) for name, field in Config.model_fields.items()]


def write_yaml(path: Path, data: object) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


# -- loading -----------------------------------------------------------------------------------


def test_no_arguments_gives_the_defaults() -> None:
    cfg = load_config()
    assert cfg == Config()
    assert cfg.rollout.max_staleness == 1
    assert cfg.model.path is None
    assert cfg.reward.function == "streamrl.reward.rule:arith_exact_match"


REPO = Path(__file__).parents[2]


def test_the_example_file_is_the_embedded_default() -> None:
    assert load_config([str(REPO / "examples" / "arith.yaml")]) == Config()


def readme_train_commands() -> list[list[str]]:
    """The arguments of every `streamrl train ...` line of the README's code blocks (comments,
    line continuations and `--resume RUN_DIR` removed)."""
    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        words = line.split("#")[0].split()
        if words[:2] == ["streamrl", "train"]:
            args = words[2:]
            if args[:1] == ["--resume"]:
                args = args[2:]
            commands.append(args)
    return commands


def test_every_train_command_of_the_readme_is_a_valid_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(REPO)  # the README's paths are relative to the repository
    commands = readme_train_commands()
    assert len(commands) >= 6 and ["examples/arith.yaml"] == commands[1][:1]
    for args in commands:
        load_config(args)  # raises ConfigError naming the key


def test_files_and_overrides_apply_left_to_right(tmp_path: Path) -> None:
    first = write_yaml(
        tmp_path / "a.yaml",
        {"rollout": {"group_size": 4, "batch_prompts": 3}, "trainer": {"steps": 7}},
    )
    second = write_yaml(tmp_path / "b.yaml", {"rollout": {"group_size": 6}})
    cfg = load_config([first, "rollout.batch_prompts=5", second, "trainer.steps=9"])
    assert cfg.rollout.group_size == 6  # the later file wins...
    assert cfg.rollout.batch_prompts == 5  # ...and merges into, not replaces, the section
    assert cfg.trainer.steps == 9

    cfg = load_config(["trainer.steps=9", first])
    assert cfg.trainer.steps == 7  # a file after an override overrides it


def test_override_strings_are_coerced_to_field_types() -> None:
    cfg = load_config(
        [
            "algorithm.lr=1e-5",
            "rollout.max_staleness=2",
            "model.path=null",
            "algorithm.off_policy.tis_cap=null",
        ]
    )
    assert cfg.algorithm.lr == 1e-5 and isinstance(cfg.algorithm.lr, float)
    assert cfg.rollout.max_staleness == 2 and isinstance(cfg.rollout.max_staleness, int)
    assert cfg.model.path is None
    assert cfg.algorithm.off_policy.tis_cap is None

    cfg = load_config(["model.path=/models/x", "run.tensorboard=false", "model.dtype=bfloat16"])
    assert (cfg.model.path, cfg.run.tensorboard, cfg.model.dtype) == (
        "/models/x",
        False,
        "bfloat16",
    )


def test_an_override_value_yaml_cannot_read_as_a_scalar_is_the_text_itself() -> None:
    template = "Q: {prompt} A: [think] then answer"  # not YAML; `a: b` reads as a mapping
    cfg = load_config([f"data.prompt_template={template}", "data.system_prompt=Say: hi"])
    assert cfg.data.prompt_template == template and cfg.data.system_prompt == "Say: hi"
    kwargs = load_config(["rollout.vllm.engine_kwargs={enable_chunked_prefill: false}"])
    assert kwargs.rollout.vllm.engine_kwargs == {"enable_chunked_prefill": False}


def test_empty_override_value_means_none() -> None:
    assert load_config(["model.path=/x", "model.path="]).model.path is None


# -- errors --------------------------------------------------------------------------------------


def test_unknown_key_lists_the_allowed_keys() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["rollout.max_stalenes=2"])
    message = str(err.value)
    assert "rollout.max_stalenes" in message
    assert "max_staleness" in message and "group_size" in message

    with pytest.raises(ConfigError, match="'modle'.*allowed: .*model"):
        load_config(["modle.path=x"])


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("trainer.lr", "algorithm.lr"),  # the same name in another section
        ("lr", "algorithm.lr"),
        ("algorithm.loss.clip", "algorithm.loss.clip_eps_low"),  # the start of a longer name
        ("rollout.groupsize", "rollout.group_size"),  # a near spelling
    ],
)
def test_unknown_key_suggests_what_was_meant(key: str, meant: str) -> None:
    with pytest.raises(ConfigError, match=rf"did you mean .*\b{meant}\b"):
        load_config([f"{key}=1"])


def test_unknown_key_in_a_file_suggests_what_was_meant(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "c.yaml", {"rollout": {"temp": 0.5}})
    with pytest.raises(
        ConfigError, match=r"rollout.temp = 0.5: .*did you mean rollout.temperature"
    ):
        load_config([path])


def test_unknown_key_in_a_file_lists_the_allowed_keys(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "c.yaml", {"algorithm": {"learning_rate": 0.1}})
    with pytest.raises(ConfigError) as err:
        load_config([path])
    message = str(err.value)
    assert "algorithm.learning_rate" in message and "0.1" in message
    assert "lr" in message and "off_policy" in message


def test_value_out_of_range_names_key_value_and_bound() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["rollout.max_staleness=-1"])
    message = str(err.value)
    assert "rollout.max_staleness" in message and "-1" in message
    assert "greater than or equal to 0" in message


def test_bad_choice_names_the_allowed_choices() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["model.dtype=float16"])
    message = str(err.value)
    assert "model.dtype" in message and "float16" in message
    assert "'float32'" in message and "'bfloat16'" in message


def test_field_used_as_a_section_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"'rollout.max_staleness' is not a section"):
        load_config(["rollout.max_staleness.value=2"])


def test_cross_field_check_names_both_fields() -> None:
    with pytest.raises(ConfigError, match=r"model.hidden_size \(30\).*model.num_heads \(4\)"):
        load_config(["model.hidden_size=30"])


def test_a_compiled_trainer_needs_one_process() -> None:
    with pytest.raises(ConfigError, match="trainer.compile.*world_size is 2"):
        load_config(["trainer.compile=true", "trainer.world_size=2"])


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml.*does not exist.*key=value"):
        load_config([str(missing)])


def test_file_that_is_not_a_mapping_is_a_config_error(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "list.yaml", [1, 2])
    with pytest.raises(ConfigError, match="list.yaml.*must hold a mapping, got list"):
        load_config([path])


def test_invalid_yaml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("rollout: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml.*not valid YAML"):
        load_config([str(path)])


def test_override_into_a_section_left_empty_in_a_file(tmp_path: Path) -> None:
    # `model:` with every field commented out loads as None; an override fills it in.
    path = tmp_path / "empty_section.yaml"
    path.write_text("model:\n  # path: /models/x\n")
    assert load_config([str(path), "model.path=/models/y"]).model.path == "/models/y"


def test_override_into_a_value_that_is_not_a_section(tmp_path: Path) -> None:
    path = tmp_path / "scalar_section.yaml"
    path.write_text("rollout: 3\n")
    with pytest.raises(ConfigError, match="rollout"):
        load_config([str(path), "rollout.max_staleness=2"])


# -- dump_yaml ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [[], ["algorithm.lr=1e-5", "model.path=/models/a b", "algorithm.off_policy.tis_cap=null"]],
)
def test_dump_yaml_parses_back_to_the_same_config(overrides: list[str]) -> None:
    cfg = load_config(overrides)
    assert Config.model_validate(yaml.safe_load(dump_yaml(cfg))) == cfg


def test_dump_yaml_round_trips_a_long_string() -> None:
    cfg = load_config(["run.run_dir=" + "runs/my experiment " * 6])
    assert Config.model_validate(yaml.safe_load(dump_yaml(cfg))) == cfg


def test_dump_yaml_leaves_the_weight_token_out(tmp_path, monkeypatch) -> None:
    tcp = ["runtime.weights.channel=tcp", "runtime.weights.bind=0.0.0.0"]
    cfg = load_config([*tcp, "runtime.weights.token=s3cret-token"])
    saved = tmp_path / "config.yaml"  # as the run directory keeps it
    saved.write_text(dump_yaml(cfg))
    assert "s3cret-token" not in saved.read_text()
    resumed = load_config([str(saved)])
    assert resumed.runtime.weights.token is None
    assert resumed.model_copy(update={"runtime": cfg.runtime}) == cfg  # nothing else is lost
    # A resumed run takes the token from the command line or the environment again; without
    # either, a tcp run beyond loopback stops before it starts and says so.
    again = load_config([str(saved), "runtime.weights.token=s3cret-token"])
    assert again.runtime.weights.token == "s3cret-token"
    from streamrl.runtime.preflight import check_paths

    monkeypatch.delenv("STREAMRL_WEIGHT_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"without a token: .*\$STREAMRL_WEIGHT_TOKEN"):
        check_paths(resumed)


def test_dump_yaml_has_every_docstring_as_a_comment() -> None:
    comment_lines = {
        line.strip() for line in dump_yaml(Config()).splitlines() if line.strip().startswith("#")
    }
    for section_name, section in sections():
        assert f"# {Config.model_fields[section_name].description}" in comment_lines
        for name, field in section.model_fields.items():
            for doc_line in field.description.split("\n"):
                assert f"# {doc_line.strip()}" in comment_lines, f"{section_name}.{name}"


def test_every_field_has_a_default_and_a_docstring() -> None:
    for section_name, section in sections():
        field = Config.model_fields[section_name]
        assert not field.is_required() and field.description, section_name
        for name, field in section.model_fields.items():
            assert not field.is_required(), f"{section_name}.{name} has no default"
            assert field.description and field.description.strip(), f"{section_name}.{name}"


def test_assignment_is_validated() -> None:
    cfg = Config()
    with pytest.raises(ValidationError, match="group_size"):
        cfg.rollout.group_size = 1
    with pytest.raises(ValidationError, match="no attribute .max_stalenes."):
        cfg.rollout.max_stalenes = 1


# -- CLI ------------------------------------------------------------------------------------------


@pytest.fixture
def quiet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # `main` setdefaults these; setting them here first lets monkeypatch undo it afterwards.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def test_cli_config_show_prints_the_resolved_config(
    quiet_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", "rollout.max_staleness=3"]) == 0
    out = capsys.readouterr().out
    assert "  max_staleness: 3" in out.splitlines()
    assert yaml.safe_load(out)["rollout"]["max_staleness"] == 3


def test_cli_bad_override_returns_2_and_names_the_key(
    quiet_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", "rollout.max_stalenes=3"]) == 2
    captured = capsys.readouterr()
    assert "rollout.max_stalenes" in captured.err
    assert captured.out == ""


def refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *overrides: str) -> str:
    """Run `streamrl train OVERRIDES`; assert it is refused (exit 2) before any work (no run
    directory made); return what it printed on stderr."""
    assert main(["train", *overrides, f"run.run_dir={tmp_path / 'run'}"]) == 2
    assert not (tmp_path / "run").exists()
    return capsys.readouterr().err


def test_cli_refuses_a_model_whose_tokenizer_has_no_chat_template(
    quiet_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamrl.models.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # the tokenizer is all the check reads
    err = refused(tmp_path, capsys, f"model.path={tmp_path}")
    assert "no chat template: set data.chat_template=false" in err


def test_cli_refuses_a_model_the_builtin_engine_cannot_run(
    quiet_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import GPT2Config

    from streamrl.models.tokenizer import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path)
    GPT2Config(n_embd=32, n_layer=1, n_head=2).save_pretrained(tmp_path)
    err = refused(tmp_path, capsys, f"model.path={tmp_path}")
    assert "model_type 'gpt2'; use one of those or rollout.engine=vllm" in err


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed")
def test_cli_refuses_an_engine_that_is_not_installed(
    quiet_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "SGLang is not installed here" in refused(tmp_path, capsys, "rollout.engine=sglang")


def test_the_console_script_finds_a_reward_module_in_the_current_directory(tmp_path: Path) -> None:
    (tmp_path / "my_reward.py").write_text(
        "def score(response, answer, **extra):\n    return 0.0\n"
    )
    script = Path(sys.executable).parent / "streamrl"  # not `python -m`: that adds the cwd itself
    proc = subprocess.run(
        [str(script), "train", "reward.function=my_reward:score", "model.path=absent"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Past the reward check, stopped at the next one.
    assert proc.returncode == 2 and "model.path = 'absent' does not exist" in proc.stderr


def test_cli_eval_says_what_it_cannot_evaluate(
    quiet_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", str(tmp_path)]) == 2
    assert "neither a run directory (config.yaml) nor a model directory" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text(dump_yaml(load_config([])))
    assert main(["eval", str(tmp_path)]) == 2
    assert "has no checkpoint yet: nothing trained to evaluate" in capsys.readouterr().err


def test_a_new_run_from_a_trained_model_is_warned_of_a_learning_rate_far_above_its_last(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from streamrl.runtime.preflight import warn_on_a_trained_model

    (tmp_path / "config.yaml").write_text(dump_yaml(load_config([])))  # ended at 3e-5
    model = tmp_path / "checkpoints" / "step-000100" / "model"
    model.mkdir(parents=True)
    for lr, warned in (("3e-4", True), ("3e-5", False)):
        caplog.clear()
        warn_on_a_trained_model(load_config([f"model.path={model}", f"algorithm.lr={lr}"]))
        assert ("whose learning rate ended at 3e-05" in caplog.text) == warned, caplog.text
    warn_on_a_trained_model(load_config([f"model.path={tmp_path}"]))  # not a checkpoint's model
    assert "learning rate" not in caplog.text


def test_cli_refuses_a_dataset_without_a_usable_row_before_any_work(
    quiet_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("oops\n")
    err = refused(tmp_path, capsys, f"data.train_file={bad}")
    assert f"dataset {str(bad)!r} has no valid row" in err
    pattern = str(tmp_path / "train-*.jsonl")  # a pattern is not refused as a missing path
    err = refused(tmp_path, capsys, f"data.train_file={pattern}")
    assert f"dataset pattern {pattern!r} matches no data file" in err


def test_cli_refuses_cuda_without_a_gpu(
    quiet_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    err = refused(tmp_path, capsys, "trainer.device=cuda")
    assert "trainer.device = 'cuda', but torch sees no GPU here" in err


def test_cli_refuses_a_head_size_vllms_cpu_attention_cannot_run(
    quiet_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from transformers import Qwen3Config

    from streamrl.runtime.preflight import check_vllm_cpu_head_size

    if importlib.util.find_spec("vllm") is None or torch.cuda.is_available():
        pytest.skip("needs vLLM's CPU build on a machine without a GPU")
    err = refused(tmp_path, capsys, "rollout.engine=vllm", "model.num_heads=8")
    assert "vLLM's CPU attention runs head sizes 32, 64," in err
    assert "the built-in model's (model.hidden_size=128 / model.num_heads=8) is 16" in err
    Qwen3Config(hidden_size=256, num_attention_heads=4, head_dim=48).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=f"model.path's \\({tmp_path}\\) is 48"):
        check_vllm_cpu_head_size(load_config(["rollout.engine=vllm", f"model.path={tmp_path}"]))
    check_vllm_cpu_head_size(load_config(["rollout.engine=vllm"]))  # the default model: 32


def fake_checkpoint(run_dir: Path, next_step: int) -> Path:
    """A whole checkpoint as far as `--resume`'s checks look: its state, an empty trainer file
    and the manifest of both."""
    from streamrl.trainer.checkpoint import STATE_FILE, TRAINER_FILE, seal

    folder = run_dir / "checkpoints" / f"step-{next_step:06d}"
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text(json.dumps({"next_step": next_step}))
    (folder / TRAINER_FILE).write_bytes(b"")
    seal(folder)
    return folder


def test_cli_resume_refuses_overrides_that_change_the_data_order(
    quiet_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.yaml").write_text(dump_yaml(load_config(["trainer.steps=3"])))
    last = fake_checkpoint(tmp_path, 2)
    before = (tmp_path / "config.yaml").read_text()
    args = ["train", "--resume", str(tmp_path), "rollout.batch_prompts=16", "data.seed=3"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "rollout.batch_prompts 32 -> 16, data.seed 0 -> 3" not in err  # listed in key order
    assert "data.seed 0 -> 3, rollout.batch_prompts 32 -> 16 would change which prompts" in err
    assert f"model.path={last / 'model'} algorithm.lr=3e-05 (about the rate it ended at" in err
    assert (tmp_path / "config.yaml").read_text() == before


def test_with_a_data_file_resume_also_keeps_what_decides_which_rows_fit(tmp_path: Path) -> None:
    from streamrl.runtime.preflight import check_same_data_order

    data = tmp_path / "train.jsonl"
    builtin, own = load_config([]), load_config([f"data.train_file={data}"])
    longer = ["rollout.max_new_tokens=64"]
    check_same_data_order(builtin, load_config(longer), tmp_path)  # the built-in task: fine
    with pytest.raises(ConfigError, match="rollout.max_new_tokens 24 -> 64 would change"):
        check_same_data_order(own, load_config([f"data.train_file={data}", *longer]), tmp_path)
    # Media limits decide which rows are refused (their places go to the next prompts).
    with pytest.raises(ConfigError, match="data.media.max_frames 64 -> 8 would change"):
        check_same_data_order(
            own, load_config([f"data.train_file={data}", "data.media.max_frames=8"]), tmp_path
        )


def test_a_run_is_not_resumed_on_training_rows_other_than_it_started_on(tmp_path: Path) -> None:
    from streamrl.data.dataset import PromptRow, rows_digest
    from streamrl.runtime.preflight import DATA_FILE, check_same_data

    cfg = load_config([])
    rows = [PromptRow(f"{i}+1=", str(i + 1)) for i in range(4)]
    check_same_data(cfg, tmp_path, rows, resuming=False)  # a new run records its rows
    recorded = json.loads((tmp_path / DATA_FILE).read_text())
    assert recorded == {"rows": 4, "digest": rows_digest(rows)}
    check_same_data(cfg, tmp_path, list(rows), resuming=True)  # the same rows: resumed
    for changed in (
        rows + [PromptRow("9+1=", "10")],  # a shard added to the folder
        [rows[1], rows[0], *rows[2:]],  # the same rows in another order
        [PromptRow("0+1=", "2"), *rows[1:]],  # an answer edited
    ):
        with pytest.raises(ConfigError, match="the training data changed since the run started"):
            check_same_data(cfg, tmp_path, changed, resuming=True)
    assert json.loads((tmp_path / DATA_FILE).read_text()) == recorded  # kept for the next try
    check_same_data(cfg, tmp_path, rows[:2], resuming=False)  # started over (no checkpoint)
    assert json.loads((tmp_path / DATA_FILE).read_text())["rows"] == 2


def test_cli_refuses_a_new_run_into_the_directory_of_another(
    quiet_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_yaml(load_config([])))
    before = {p: p.read_bytes() for p in run.rglob("*")}
    assert main(["train", f"run.run_dir={run}"]) == 2
    assert f"already holds a run: `streamrl train --resume {run}` continues it" in (
        capsys.readouterr().err
    )
    assert {p: p.read_bytes() for p in run.rglob("*")} == before


def test_cli_resume_of_a_finished_run_changes_nothing(
    quiet_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.yaml").write_text(dump_yaml(load_config(["trainer.steps=3"])))
    (tmp_path / "summary.json").write_text('{"num_steps": 3}')
    fake_checkpoint(tmp_path, 3)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main(["train", "--resume", str(tmp_path)]) == 0
    assert "has trained all 3 steps; nothing to do" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


# -- algorithm presets ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_fills_its_values(name: str) -> None:
    cfg = load_config([f"algorithm.preset={name}"])
    for section, values in PRESETS[name].items():
        if not isinstance(values, dict):  # a field of `algorithm` itself
            assert getattr(cfg.algorithm, section) == values, section
            continue
        for key, value in values.items():
            assert getattr(getattr(cfg.algorithm, section), key) == value, (section, key)


def test_explicit_values_override_the_preset(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  preset: dapo\n  loss:\n    clip_eps_high: 0.4\n")
    cfg = load_config([str(path), "algorithm.dynamic_sampling.enabled=false"])
    assert cfg.algorithm.loss.clip_eps_high == 0.4
    assert cfg.algorithm.dynamic_sampling.enabled is False
    assert cfg.algorithm.shaping.overlong_cache == PRESETS["dapo"]["shaping"]["overlong_cache"]


def test_default_is_the_grpo_preset() -> None:
    assert load_config([]).algorithm == load_config(["algorithm.preset=grpo"]).algorithm


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ConfigError, match=r"algorithm.preset = 'ppo2'.*'dapo'.*'rloo'"):
        load_config(["algorithm.preset=ppo2"])


def test_kl_in_reward_needs_a_kl_coefficient() -> None:
    with pytest.raises(ConfigError, match="in_reward=true needs algorithm.kl.coef > 0"):
        load_config(["algorithm.kl.in_reward=true"])


def test_overrides_may_follow_options_on_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = parse_command_line(["eval", "RUN", "--json", "data.num_eval=8", "--samples", "4", "a=1"])
    assert (args.target, args.args, args.json, args.samples) == (
        "RUN",
        ["data.num_eval=8", "a=1"],
        True,
        4,
    )
    args = parse_command_line(["train", "x.yaml", "--resume", "RUN", "trainer.steps=5"])
    assert (args.args, args.resume) == (["x.yaml", "trainer.steps=5"], "RUN")  # in order
    with pytest.raises(SystemExit) as refused:
        parse_command_line(["eval", "RUN", "--jsn", "data.num_eval=8"])
    assert refused.value.code == 2 and "unrecognized arguments: --jsn" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a command without overrides takes no extra words
        parse_command_line(["stop", "RUN", "extra"])


def test_old_flat_keys_are_accepted_with_a_warning_naming_the_new_key(caplog, tmp_path) -> None:
    """The config became nested; a key of the flat layout still works for one release."""
    old = tmp_path / "old.yaml"
    old.write_text(
        "algorithm:\n  kl_coef: 0.02\n  advantage: rloo\nruntime:\n  roles:\n    rollout:\n      replicas: 2\n"
    )
    with caplog.at_level("WARNING", logger="streamrl.config"):
        cfg = load_config(
            [str(old), "rollout.vllm_dtype=bfloat16", "algorithm.dynamic_sampling=true"]
        )
    assert cfg.algorithm.kl.coef == 0.02
    assert cfg.algorithm.advantage.estimator == "rloo"
    assert cfg.runtime.ray.roles.rollout.replicas == 2
    assert cfg.rollout.vllm.dtype == "bfloat16"
    assert cfg.algorithm.dynamic_sampling.enabled is True
    said = caplog.text
    for old_key, new_key in (
        ("algorithm.kl_coef", "algorithm.kl.coef"),
        ("algorithm.advantage", "algorithm.advantage.estimator"),
        ("runtime.roles", "runtime.ray.roles"),
        ("rollout.vllm_dtype", "rollout.vllm.dtype"),
    ):
        assert f"{old_key!r} is now {new_key!r}" in said


def test_a_new_section_is_not_mistaken_for_an_old_key() -> None:
    cfg = load_config(
        ["algorithm.advantage.scale=batch", "algorithm.dynamic_sampling.enabled=true"]
    )
    assert cfg.algorithm.advantage.scale == "batch" and cfg.algorithm.advantage.estimator == "grpo"
    assert cfg.algorithm.dynamic_sampling.enabled


@pytest.mark.parametrize(
    "override",
    [
        "algorithm.lr=nan",
        "algorithm.off_policy.tis_cap=.inf",
        "algorithm.grad_clip=nan",
        "reward.timeout_s=inf",
        "reward.invalid_output_penalty=-.inf",
        "runtime.lease_s=inf",
    ],
)
def test_no_number_may_be_nan_or_infinite(override: str) -> None:
    with pytest.raises(ConfigError, match="finite number"):
        load_config([override])


@pytest.mark.parametrize(
    "example", sorted(p.name for p in (Path(__file__).parents[2] / "examples").glob("*.yaml"))
)
def test_every_example_config_loads(example):
    """The recipes in examples/ stay in step with the config: a renamed or removed key fails."""
    from streamrl.config import load_config

    cfg = load_config([str(Path(__file__).parents[2] / "examples" / example)])
    if example == "gsm8k_qwen.yaml":  # the GPU recipe: bf16 compute over fp32 master weights
        assert cfg.rollout.engine == "vllm" and cfg.model.dtype == "bfloat16"
        assert cfg.trainer.mixed_precision and cfg.trainer.device == "cuda"


def test_vision_family_picks_the_built_in_vision_model_and_keys_its_warm_start() -> None:
    from streamrl.trainer.sft import warm_start_key

    qwen3 = load_config(["examples/vision.yaml", "model.vision_family=qwen3_vl"])
    default = load_config(["examples/vision.yaml"])
    assert warm_start_key(qwen3) != warm_start_key(default)
    for args in (["data.task=arith"], ["examples/vision.yaml", "model.path=/some/model"]):
        with pytest.raises(ConfigError, match="model.vision_family='qwen3_vl' picks the built-in"):
            load_config([*args, "model.vision_family=qwen3_vl"])
