"""Built-in arithmetic task, JSONL datasets, prompt encoding and the feeder's bus rows."""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamrl.api import fields as F
from streamrl.api.role import LoopPolicy
from streamrl.config import ConfigError, load_config
from streamrl.data.arith import has_carry, is_eval_pair, sample_problems, worked_solution
from streamrl.data.dataset import MAX_WARNINGS, PromptRow, builtin_rows, load_rows
from streamrl.data.feeder import PromptFeeder
from streamrl.data.prompts import encode_prompt, encode_response, prompt_lengths_over
from streamrl.data.role import FeederRole
from streamrl.models.tokenizer import build_tokenizer
from streamrl.runtime.context import hold_out, load_datasets, prepare


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# -- the arithmetic task ---------------------------------------------------------------------


def test_worked_solution_examples() -> None:
    assert worked_solution(37, 85) == "7+5=12,3+8+1=12:122"
    assert worked_solution(37, 85, carry=False) == "7+5=12,3+8=11:12"
    assert worked_solution(99, 99, carry=False).endswith(":88")
    assert worked_solution(5, 123) == "5+3=8,0+2=2,0+1=1:128"
    assert worked_solution(0, 0) == "0+0=0:0"


@given(st.integers(0, 10**6 - 1), st.integers(0, 10**6 - 1))
def test_worked_solution_ends_with_the_sum(a: int, b: int) -> None:
    assert worked_solution(a, b).rpartition(":")[2] == str(a + b)


@given(st.integers(0, 999), st.integers(0, 999))
def test_forgetting_the_carry_only_matters_when_there_is_one(a: int, b: int) -> None:
    wrong = int(worked_solution(a, b, carry=False).rpartition(":")[2])
    assert (wrong != a + b) == has_carry(a, b)


def test_eval_and_train_splits_are_disjoint() -> None:
    train = {(p.a, p.b) for p in sample_problems(3000, digits=2, seed=0, split="train")}
    evals = {(p.a, p.b) for p in sample_problems(300, digits=2, seed=0, split="eval")}
    assert train and evals and not train & evals
    assert all(is_eval_pair(a, b, 0.1) for a, b in evals)


def test_sample_problems_is_deterministic_per_seed() -> None:
    def draw(seed: int) -> list[tuple[int, int]]:
        return [(p.a, p.b) for p in sample_problems(50, digits=3, seed=seed, split="train")]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    assert all(0 <= x <= 999 for pair in draw(1) for x in pair)


def test_sample_problems_rejects_an_unknown_split() -> None:
    with pytest.raises(ValueError, match="'train' or 'eval'.*'test'"):
        sample_problems(1, digits=2, seed=0, split="test")


def test_builtin_rows_hold_prompt_and_answer() -> None:
    row = builtin_rows(1, digits=2, seed=0, split="train")[0]
    a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", row.prompt).groups())
    assert row.answer == str(a + b) and row.extra == {}


# -- JSONL datasets ---------------------------------------------------------------------------


def test_load_jsonl_skips_malformed_lines_and_says_where(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    lines = [
        json.dumps({"prompt": "1+1=", "answer": "2"}),
        "{not json",
        "",
        json.dumps(["a", "list"]),
        json.dumps({"prompt": "2+2="}),
        json.dumps({"prompt": "", "answer": "0"}),
        json.dumps({"prompt": "3+3=", "answer": [6]}),
        json.dumps({"prompt": "4+4=", "answer": 8, "level": "easy"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    report = load_rows(path)
    assert report.rows == [
        PromptRow("1+1=", "2"),
        PromptRow("4+4=", "8", {"level": "easy"}),
    ]
    assert report.num_skipped == 5
    assert [p.split(": ")[0] for p in report.problems] == [f"{path}:{n}" for n in (2, 4, 5, 6, 7)]
    assert "missing key(s) ['answer']" in report.problems[2]


def test_load_jsonl_without_a_valid_row_raises(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "x"}\nnot json\n')
    with pytest.raises(ValueError, match=r"no valid row \(2 malformed; the first: .*bad.jsonl:1: "):
        load_rows(path)


def test_load_jsonl_reports_the_first_malformed_rows_and_counts_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "messy.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n' + "oops\n" * 25)
    with caplog.at_level(logging.WARNING, logger="streamrl.data.dataset"):
        report = load_rows(path)
    assert report.num_skipped == 25 and len(report.problems) == 25
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == MAX_WARNINGS + 1
    assert messages[-1] == f"{path}: {25 - MAX_WARNINGS} more malformed rows skipped (25 in all)"


def test_a_json_file_may_hold_json_lines_or_one_array_of_records(tmp_path: Path) -> None:
    lines = tmp_path / "lines.json"
    lines.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": 4}\n')
    assert [(r.prompt, r.answer) for r in load_rows(lines).rows] == [("1+1=", "2"), ("2+2=", "4")]
    array = tmp_path / "array.json"
    array.write_text('\n [{"prompt": "1+1=", "answer": "2", "level": 1}, 7]')
    report = load_rows(array)
    assert [(r.prompt, r.extra) for r in report.rows] == [("1+1=", {"level": 1})]
    assert report.problems == [
        f"{array}:2: skipped malformed row: expected an object with 'prompt' and 'answer', got int"
    ]
    broken = tmp_path / "broken.json"
    broken.write_text('[{"prompt": "1+1="')
    with pytest.raises(ValueError, match="broken.json' is not a JSON array: "):
        load_rows(broken)


def test_a_folder_of_shards_reads_every_data_file_in_name_order(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "train-00001.jsonl").write_text('{"prompt": "q2", "answer": "2"}\n')
    (tmp_path / "a-00000.jsonl").write_text('{"prompt": "q1", "answer": "1"}\noops\n')
    (tmp_path / "README.md").write_text("not data")
    report = load_rows(tmp_path)
    assert [r.prompt for r in report.rows] == ["q1", "q2"]
    assert report.problems == [
        f"{tmp_path / 'a-00000.jsonl'}:2: skipped malformed row: "
        "Expecting value: line 1 column 1 (char 0)"
    ]


def test_a_folder_without_data_or_a_file_of_another_kind_is_refused_saying_what_is_read(
    tmp_path: Path,
) -> None:
    (tmp_path / "dataset_dict.json").write_text('{"splits": []}')  # bookkeeping, not data
    with pytest.raises(ValueError, match=r"holds no data file; streamrl reads JSON lines .*arrow"):
        load_rows(tmp_path)
    table = tmp_path / "train.txt"
    table.write_text("1+1= 2\n")
    with pytest.raises(
        ValueError, match=r"train.txt': streamrl reads JSON lines \(.jsonl or .json\)"
    ):
        load_rows(table)


def test_a_datasets_folder_from_save_to_disk_loads_and_a_dataset_dict_names_its_splits(
    tmp_path: Path,
) -> None:
    import datasets

    train = datasets.Dataset.from_list(
        [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(5)]
    )
    test = datasets.Dataset.from_list([{"prompt": "9+9=", "answer": "18", "level": 2}])
    train.save_to_disk(str(tmp_path / "one"))
    report = load_rows(tmp_path / "one")  # state.json and dataset_info.json are not rows
    assert [(r.prompt, r.answer, r.extra) for r in report.rows] == [
        (f"{i}+1=", str(i + 1), {"level": i % 3}) for i in range(5)
    ]
    assert report.num_skipped == 0
    both = tmp_path / "dict"
    datasets.DatasetDict(train=train, test=test).save_to_disk(str(both))
    with pytest.raises(ValueError, match="more than one split") as refused:
        load_rows(both)
    assert f"test: {str(both / 'test')!r}" in str(refused.value)
    assert f"train: {str(both / 'train')!r}" in str(refused.value)
    assert [r.answer for r in load_rows(both / "test").rows] == ["18"]


def test_hub_shards_of_two_splits_are_refused_with_a_pattern_per_split_that_then_loads(
    tmp_path: Path,
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "gsm8k" / "main"
    data.mkdir(parents=True)
    for name, answers in (
        ("train-00000-of-00002", ["1", "2"]),
        ("train-00001-of-00002", ["3"]),
        ("test-00000-of-00001", ["4"]),
    ):
        rows = [{"prompt": f"q{a}", "answer": a} for a in answers]
        pq.write_table(pa.Table.from_pylist(rows), data / f"{name}.parquet")
    with pytest.raises(ValueError, match=r"train: 2 file\(s\)") as refused:
        load_rows(tmp_path / "gsm8k")
    pattern = str(data / "train*.parquet")
    assert repr(pattern) in str(refused.value)
    assert [r.answer for r in load_rows(pattern).rows] == ["1", "2", "3"]
    with pytest.raises(ValueError, match=r"pattern .* matches no data file"):
        load_rows(str(data / "validation*.parquet"))
    (data / "train-00001-of-00002.parquet").unlink()  # veRL's layout: train and test side by side
    with pytest.raises(ValueError, match="more than one split") as refused:
        load_rows(data)
    assert repr(str(data / "train-00000-of-00002.parquet")) in str(refused.value)


def test_csv_and_tsv_files_load_with_their_header_and_malformed_rows_are_named(
    tmp_path: Path,
) -> None:
    (tmp_path / "rows.csv").write_text(
        'question,answer,level\n1+1=,2,easy\n"a, quoted\nprompt",3,hard\n2+2=,4,easy,extra\n'
    )
    report = load_rows(tmp_path / "rows.csv", prompt_key="question")
    assert [(r.prompt, r.answer, r.extra) for r in report.rows] == [
        ("1+1=", "2", {"level": "easy"}),
        ("a, quoted\nprompt", "3", {"level": "hard"}),
    ]
    assert report.problems == [
        f"{tmp_path / 'rows.csv'}:5: skipped malformed row: "
        "1 more value(s) than the header has columns"
    ]
    (tmp_path / "rows.tsv").write_text("prompt\tanswer\n3+4=\t7\n5+5=\n")
    report = load_rows(tmp_path / "rows.tsv")
    assert [(r.prompt, r.answer) for r in report.rows] == [("3+4=", "7")]
    assert "rows.tsv:3: skipped malformed row: missing key(s) ['answer']" in report.problems[0]


def test_an_arrow_file_in_the_ipc_file_format_loads_too(tmp_path: Path) -> None:
    import pyarrow as pa

    table = pa.Table.from_pylist([{"prompt": "1+2=", "answer": "3"}])
    with pa.ipc.new_file(str(tmp_path / "rows.arrow"), table.schema) as writer:
        writer.write_table(table)
    assert [r.answer for r in load_rows(tmp_path / "rows.arrow").rows] == ["3"]
    (tmp_path / "broken.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(ValueError, match=r"broken.arrow' is not a readable arrow file"):
        load_rows(tmp_path / "broken.arrow")


def test_a_file_read_again_unchanged_is_not_reparsed_but_reports_its_problems_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import streamrl.data.dataset as dataset

    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\noops\n')
    first = load_rows(path)
    first.rows.clear()  # a caller's changes do not reach the next reader
    monkeypatch.setattr(dataset, "_read_rows", lambda *a: pytest.fail("read again"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="streamrl.data.dataset"):
        again = load_rows(path)
    assert [r.prompt for r in again.rows] == ["1+1="] and again.num_skipped == 1
    assert [r.getMessage() for r in caplog.records] == again.problems
    assert again.problems[0].startswith(f"{path}:2: skipped malformed row: ")
    monkeypatch.undo()
    path.write_text('{"prompt": "2+2=", "answer": "4"}\n')  # changed: read again
    assert [r.prompt for r in load_rows(path).rows] == ["2+2="]


def test_a_train_file_without_an_eval_file_holds_rows_out_of_it(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(50))
    )
    cfg = load_config([f"data.train_file={path}", "data.num_eval=4"])
    train, evals, skipped = load_datasets(cfg)
    assert (len(train), len(evals), skipped) == (46, 4, 0)
    assert {r.prompt for r in train}.isdisjoint({r.prompt for r in evals})
    assert sorted(train + evals, key=lambda r: int(r.answer)) == load_rows(path).rows
    assert load_datasets(cfg)[1] == evals  # the same rows every time (data.seed)
    assert len(hold_out(train + evals, 256, 0)[1]) == 5  # at most a tenth of the file
    with pytest.raises(ValueError, match="need two or more"):
        hold_out(evals[:1], 256, 0)


def write_rows(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return path


def test_prompts_that_cannot_fit_the_context_are_left_out(
    tmp_path: Path, model_dir: Path, caplog
) -> None:
    # The tiny model's context is 256 positions; 24 new tokens leave 232 for a prompt, of
    # which the chat template takes 3 (<|user|>, <|end|>, <|assistant|>).
    prompts = [f"{i}+1=" for i in range(60)]
    for i in (3, 17, 41, 58):
        prompts[i] = "1+" * 115 + f"{i}="  # 232-233 characters: 235-236 tokens
    prompts[8] = "1+" * 113 + "8="  # 228 characters, 231 tokens: fits
    path = write_rows(tmp_path / "train.jsonl", prompts)
    cfg = load_config([f"data.train_file={path}", "data.num_eval=6", "rollout.max_new_tokens=24"])
    with caplog.at_level(logging.WARNING):
        ctx = prepare(cfg, model_dir, tmp_path / "run")
    assert ctx.num_overlong_prompts == 4
    kept = [row.prompt for row in ctx.train_rows + ctx.eval_rows]
    assert len(kept) == 56 and prompts[8] in kept
    assert all(len(encode_prompt(build_tokenizer(), p)) <= 232 for p in kept)
    assert "longer than 232 tokens (the context of 256 minus rollout.max_new_tokens = 24)" in (
        caplog.text
    )
    # Shorter answers make room for them all.
    roomy = load_config([f"data.train_file={path}", "rollout.max_new_tokens=16"])
    assert prepare(roomy, model_dir, tmp_path / "run").num_overlong_prompts == 0
    no_room = load_config([f"data.train_file={path}", "rollout.max_new_tokens=250"])
    with pytest.raises(ConfigError, match="every training prompt is longer than 6 tokens"):
        prepare(no_room, model_dir, tmp_path / "run")


@given(st.lists(st.text(alphabet="0123456789+=: abc", max_size=40), min_size=1, max_size=20))
def test_lengths_over_a_limit_are_the_exact_encoded_lengths(texts: list[str]) -> None:
    tokenizer = build_tokenizer()
    exact = {i: len(encode_prompt(tokenizer, t)) for i, t in enumerate(texts)}
    for limit in (5, 20, 40):
        over = prompt_lengths_over(tokenizer, texts, limit)
        assert over == {i: n for i, n in exact.items() if n > limit}


CONVERSATION = [
    {"role": "system", "content": "answer with the sum"},
    {"role": "user", "content": "1+2="},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "4+5="},
]


def test_a_prompt_may_be_a_conversation(tmp_path: Path) -> None:
    rows = [
        {"prompt": CONVERSATION, "answer": 9},
        {"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"},  # as its text
        {"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"prompt": [{"role": "tool", "content": "x"}], "answer": "1"},
        {"prompt": [{"role": "user"}], "answer": "1"},
        {"prompt": [], "answer": "1"},
    ]
    rows[2]["answer"] = "1"
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = load_rows(path)
    assert [row.prompt for row in report.rows] == [CONVERSATION, "2+2="]
    assert report.num_skipped == 4
    assert "must end with a non-empty user message, not {'role': 'assistant'" in report.problems[0]
    assert 'message 0 must be {"role": one of system, user, assistant' in report.problems[1]
    assert "'role': 'user'}" in report.problems[2]
    assert "non-empty string or a list of chat messages, got []" in report.problems[3]


def test_a_conversation_is_encoded_through_the_chat_template(tokenizer) -> None:
    ids = encode_prompt(tokenizer, CONVERSATION)
    expected = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert tokenizer.decode(ids).endswith("<|user|>4+5=<|end|><|assistant|>")
    with pytest.raises(ValueError, match="cannot be used with data.chat_template=false"):
        encode_prompt(tokenizer, CONVERSATION, chat_template=False)


def test_conversations_need_the_chat_template(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": CONVERSATION, "answer": "9"}) + "\n" * 2)
    path.write_text(path.read_text() + json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    cfg = load_config([f"data.train_file={path}", f"data.eval_file={path}"])
    assert load_datasets(cfg)[0][0].prompt == CONVERSATION
    plain = load_config([f"data.train_file={path}", "data.chat_template=false"])
    with pytest.raises(ValueError, match="1 row"):
        load_datasets(plain)


def test_a_prompt_template_and_a_system_prompt_format_every_prompt(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": CONVERSATION, "answer": "9"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    template = "Q: {prompt} A: \\boxed{}"  # other braces stay as they are
    cfg = load_config(
        [f"data.train_file={path}", f"data.eval_file={path}", f"data.prompt_template={template}"]
    )
    train, evals, _ = load_datasets(cfg)
    assert train == evals and train[0].prompt == "Q: 1+2= A: \\boxed{}"
    assert train[1].prompt == [
        *CONVERSATION[:3],
        {"role": "user", "content": "Q: 4+5= A: \\boxed{}"},
    ]
    cfg = load_config(
        [f"data.train_file={path}", f"data.eval_file={path}", "data.system_prompt=be brief"]
    )
    train, _, _ = load_datasets(cfg)
    assert train[0].prompt == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+2="},
    ]
    assert train[1].prompt == CONVERSATION  # its own system message stays
    builtin = load_datasets(load_config(["data.prompt_template=>{prompt}<"]))
    assert all(row.prompt.startswith(">") and row.prompt.endswith("<") for row in builtin[1])


def test_prompt_formats_that_cannot_work_are_refused() -> None:
    with pytest.raises(ConfigError, match="prompt_template needs '{prompt}'"):
        load_config(["data.prompt_template=Q: A:"])
    with pytest.raises(ConfigError, match="system_prompt needs chat_template=true"):
        load_config(["data.system_prompt=hi", "data.chat_template=false"])


@given(
    st.lists(
        st.lists(
            st.tuples(
                st.sampled_from(["system", "user", "assistant"]), st.text("0123+=ab", max_size=30)
            ),
            min_size=1,
            max_size=4,
        ),
        min_size=1,
        max_size=10,
    )
)
def test_lengths_of_conversations_over_a_limit_are_the_exact_encoded_lengths(turns) -> None:
    tokenizer = build_tokenizer()
    prompts = [
        [{"role": role, "content": text} for role, text in conversation]
        + [{"role": "user", "content": "1+1="}]
        for conversation in turns
    ]
    prompts.append("a text among them")
    exact = {i: len(encode_prompt(tokenizer, p)) for i, p in enumerate(prompts)}
    for limit in (5, 20, 60):
        over = prompt_lengths_over(tokenizer, prompts, limit)
        assert over == {i: n for i, n in exact.items() if n > limit}


def test_a_verl_parquet_file_loads_with_its_own_keys(tmp_path: Path) -> None:
    import pyarrow as pa  # a base dependency
    import pyarrow.parquet as pq

    # The shape of veRL's GSM8K files: a conversation prompt, the answer in a nested record.
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + {i}? Answer after ####."}],
            "ability": "math",
            "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
            "extra_info": {"index": i},
        }
        for i in range(5)
    ]
    rows[3]["reward_model"] = {"style": "rule"}  # no answer: reported with its row number
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = load_config(
        [
            f"data.train_file={path}",
            f"data.eval_file={path}",
            "data.answer_key=reward_model.ground_truth",
        ]
    )
    train, evals, skipped = load_datasets(cfg)
    assert skipped == 2 and len(train) == len(evals) == 4  # each file read once, both reported
    assert train[1] == PromptRow(
        "What is 1 + 1? Answer after ####.",
        "2",
        {
            "data_source": "openai/gsm8k",
            "ability": "math",
            "reward_model": {"ground_truth": "2", "style": "rule"},
            "extra_info": {"index": 1},
        },
    )
    [problem] = load_rows(path, answer_key="reward_model.ground_truth").problems
    assert problem.startswith(
        f"{path}:4: skipped malformed row: missing key(s) ['reward_model.ground_truth']"
    )
    with pytest.raises(ValueError, match="no valid row"):  # the default keys find no answer
        load_rows(path)


def test_load_jsonl_of_a_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_rows(tmp_path / "missing.jsonl")


# -- prompts ----------------------------------------------------------------------------------


def test_encode_prompt_uses_the_chat_template(tokenizer) -> None:
    ids = encode_prompt(tokenizer, "1+2=")
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens == ["<|user|>", "1", "+", "2", "=", "<|end|>", "<|assistant|>"]


def test_encode_prompt_without_the_chat_template_is_the_text_as_it_is(tokenizer) -> None:
    ids = encode_prompt(tokenizer, "1+2=", chat_template=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["1", "+", "2", "="]


def test_a_tokenizer_without_a_chat_template_says_what_to_do(tokenizer) -> None:
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template: set data.chat_template=false"):
        encode_prompt(plain, "1+2=")
    assert encode_prompt(plain, "1+2=", chat_template=False) == tokenizer("1+2=")["input_ids"]


def test_encode_response_ends_with_eos(tokenizer) -> None:
    ids = encode_response(tokenizer, "1+2=3:3")
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[:-1]) == "1+2=3:3"


# -- the feeder -------------------------------------------------------------------------------

NUM_ROWS, BATCH_PROMPTS, GROUP_SIZE = 6, 2, 3


@pytest.fixture
def rows() -> list[PromptRow]:
    # Distinct answers, so a bus row's answer tells which prompt it came from.
    return [PromptRow(f"{i}+{i}=", str(2 * i), {"i": i}) for i in range(NUM_ROWS)]


def make_feeder(rows: list[PromptRow], tokenizer, seed: int = 0) -> PromptFeeder:
    return PromptFeeder(
        rows, tokenizer, batch_prompts=BATCH_PROMPTS, group_size=GROUP_SIZE, seed=seed
    )


def comparable(batch: list[dict]) -> list[tuple]:
    return [
        (
            r["sample_id"],
            r["group_id"],
            r["fields"][F.ANSWER],
            r["fields"][F.PROMPT_IDS].tolist(),
        )
        for r in batch
    ]


def test_batch_rows_ids_and_groups(rows: list[PromptRow], tokenizer) -> None:
    batch = make_feeder(rows, tokenizer).batch(4)
    assert len(batch) == BATCH_PROMPTS * GROUP_SIZE
    assert [r["sample_id"] for r in batch] == [
        f"b4-p{j}-s{k}" for j in range(BATCH_PROMPTS) for k in range(GROUP_SIZE)
    ]
    for j in range(BATCH_PROMPTS):
        group = batch[j * GROUP_SIZE : (j + 1) * GROUP_SIZE]
        assert {r["group_id"] for r in group} == {f"b4-p{j}"}
        assert {r["fields"][F.ANSWER] for r in group} == {group[0]["fields"][F.ANSWER]}
    assert all(r["group_size"] == GROUP_SIZE and r["batch_index"] == 4 for r in batch)


def test_batch_prompt_ids_are_the_encoded_prompt(rows: list[PromptRow], tokenizer) -> None:
    by_answer = {row.answer: row for row in rows}
    for r in make_feeder(rows, tokenizer).batch(0):
        row = by_answer[r["fields"][F.ANSWER]]
        assert r["fields"][F.PROMPT_IDS].dtype == np.int64
        assert r["fields"][F.PROMPT_IDS].tolist() == encode_prompt(tokenizer, row.prompt)
        assert r["fields"][F.EXTRA] == row.extra


def test_the_feeder_can_skip_the_chat_template(rows: list[PromptRow], tokenizer) -> None:
    feeder = PromptFeeder(
        rows,
        tokenizer,
        batch_prompts=BATCH_PROMPTS,
        group_size=GROUP_SIZE,
        seed=0,
        chat_template=False,
    )
    by_answer = {row.answer: row for row in rows}
    for r in feeder.batch(0):
        raw = tokenizer(by_answer[r["fields"][F.ANSWER]].prompt)["input_ids"]
        assert r["fields"][F.PROMPT_IDS].tolist() == raw


def test_batch_is_a_function_of_seed_and_index(rows: list[PromptRow], tokenizer) -> None:
    feeder = make_feeder(rows, tokenizer)
    first = comparable(feeder.batch(1))
    feeder.batch(7)  # a later epoch in between must not change batch 1
    assert comparable(feeder.batch(1)) == first
    assert comparable(make_feeder(rows, tokenizer).batch(1)) == first
    other_seeds = [comparable(make_feeder(rows, tokenizer, seed=s).batch(1)) for s in (1, 2, 3)]
    assert any(b != first for b in other_seeds)


def test_each_epoch_visits_every_prompt_once(rows: list[PromptRow], tokenizer) -> None:
    feeder = make_feeder(rows, tokenizer)
    batches_per_epoch = NUM_ROWS // BATCH_PROMPTS
    for epoch in range(2):
        answers = [
            r["fields"][F.ANSWER]
            for b in range(epoch * batches_per_epoch, (epoch + 1) * batches_per_epoch)
            for r in feeder.batch(b)[::GROUP_SIZE]
        ]
        assert sorted(answers) == sorted(row.answer for row in rows)


class _CountingFeeder(PromptFeeder):
    """A feeder that counts the prompts it encodes (where a multimodal one prepares media)."""

    encoded = 0

    def _encode(self, idx: int) -> bool:
        self.encoded += idx not in self._prompt_ids
        return super()._encode(idx)


class _Bus:
    def __init__(self):
        self.room, self.waits, self.added = False, [], []

    def can_add(self, num_groups: int, wait_s: float = 0.0) -> bool:
        self.waits.append(wait_s)
        return self.room

    def add_rows(self, rows) -> None:
        self.added.append(rows)


def test_the_feeder_role_encodes_the_next_batch_while_the_bus_is_full(
    rows: list[PromptRow], tokenizer
) -> None:
    bus = _Bus()
    feeder = _CountingFeeder(
        rows, tokenizer, batch_prompts=BATCH_PROMPTS, group_size=GROUP_SIZE, seed=0
    )
    role = FeederRole(bus, feeder, start_batch=2, end_batch=4)
    role.configure(LoopPolicy(wait_s=0.05))
    assert role.step() is True  # no room: batch 2's prompts are encoded meanwhile
    assert feeder.encoded == BATCH_PROMPTS and bus.waits == [0.0] and not bus.added
    assert role.step() is False  # encoded already: now it waits for room as long as it may
    assert bus.waits[-1] == 0.05 and feeder.encoded == BATCH_PROMPTS
    bus.room = True
    assert role.step() is True  # room: batch 2 goes on the bus with nothing left to encode
    assert feeder.encoded == BATCH_PROMPTS
    assert comparable(bus.added[0]) == comparable(make_feeder(rows, tokenizer).batch(2))
    bus.room = False
    assert role.step() is True and role.prepared_batch == 3  # then batch 3's, ahead


def test_feeder_rejects_an_empty_dataset(tokenizer) -> None:
    with pytest.raises(ValueError, match="empty"):
        make_feeder([], tokenizer)
