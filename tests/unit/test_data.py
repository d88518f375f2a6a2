import datetime
import decimal
import json
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rolloutpipe.model import build_tiny_tokenizer
from rolloutpipe.rollout.data import DataConfig, DatasetError, PromptSource, load_prompts, prepare_data_path
from rolloutpipe.rollout.tasks import ReversalTaskConfig, reversal_reward, write_reversal_jsonl
from rolloutpipe.types import Prompt


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def make_prompts(n: int) -> list[Prompt]:
    return [Prompt(index=i, text=str(i), input_ids=[i], label=str(i)) for i in range(n)]


GOOD_ROW = json.dumps({"prompt": "ab=", "label": "ba"})


# ---- the synthetic task ------------------------------------------------------------------------


def test_synthetic_data_is_deterministic(tmp_path):
    cfg = ReversalTaskConfig(num_rows=50, length=4, alphabet_size=5, seed=7)
    first = write_reversal_jsonl(cfg, tmp_path / "a.jsonl").read_bytes()
    second = write_reversal_jsonl(cfg, tmp_path / "b.jsonl").read_bytes()
    other_cfg = ReversalTaskConfig(num_rows=50, length=4, alphabet_size=5, seed=8)
    other_seed = write_reversal_jsonl(other_cfg, tmp_path / "c.jsonl")
    assert first == second
    assert other_seed.read_bytes() != first


def test_synthetic_rows_ask_for_the_reversed_string(tmp_path):
    cfg = ReversalTaskConfig(num_rows=200, length=3, alphabet_size=4)
    rows = [json.loads(line) for line in write_reversal_jsonl(cfg, tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(rows) == 200
    for row in rows:
        text = row["prompt"][:-1]
        assert row["prompt"] == text + "="
        assert len(text) == 3 and set(text) <= set("abcd")
        assert row["label"] == text[::-1]
        assert row["metadata"] == {"task": "reversal"}
    assert len({row["prompt"] for row in rows}) > 40  # 64 strings exist; a stuck generator would repeat one


@pytest.mark.parametrize(
    "field, value",
    [("num_rows", 0), ("length", 0), ("alphabet_size", 0), ("alphabet_size", 27)],
)
def test_reversal_task_config_names_the_bad_key(field, value):
    with pytest.raises(ValueError, match=f"data.task.{field}={value}"):
        ReversalTaskConfig(**{field: value})


@pytest.mark.parametrize(
    "response, reward",
    [
        ("dba", 1.0),
        (" dba\n", 1.0),
        ("dbx", 2 / 3),
        ("dbaa", 3 / 4),
        ("db", 2 / 3),
        ("abd", 1 / 3),
        ("", 0.0),
    ],
)
def test_reversal_reward_gives_credit_per_right_position(response, reward):
    assert reversal_reward(response, "dba", {}) == pytest.approx(reward)


def test_synthetic_task_loads_and_matches_the_tokenizer(tmp_path, tokenizer):
    cfg = DataConfig(task=ReversalTaskConfig(num_rows=20))
    path = prepare_data_path(cfg, tmp_path)
    assert path == tmp_path / "data" / "reversal.jsonl"
    prompts = load_prompts(cfg, tokenizer, path)
    assert [p.index for p in prompts] == list(range(20))
    for p in prompts:
        assert tokenizer.decode(p.input_ids) == p.text
        assert len(p.input_ids) == 4  # one token per character, no special tokens added
        assert reversal_reward(p.label, p.label, p.metadata) == 1.0


# ---- loading -----------------------------------------------------------------------------------


def test_chat_template_wraps_string_and_message_prompts(tmp_path, tokenizer):
    path = write_lines(
        tmp_path / "chat.jsonl",
        [
            json.dumps({"prompt": "ab=", "label": "ba"}),
            json.dumps({"prompt": [{"role": "user", "content": "cd="}], "label": "dc"}),
            json.dumps(
                {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "ef="}], "label": "fe"}
            ),
        ],
    )
    cfg = DataConfig(apply_chat_template=True, system_prompt="rev")
    texts = [p.text for p in load_prompts(cfg, tokenizer, path)]
    assert texts == [
        "<|im_start|>system:rev<|im_end|><|im_start|>user:ab=<|im_end|><|im_start|>assistant:",
        "<|im_start|>system:rev<|im_end|><|im_start|>user:cd=<|im_end|><|im_start|>assistant:",
        "<|im_start|>system:own<|im_end|><|im_start|>user:ef=<|im_end|><|im_start|>assistant:",
    ]
    # Message lists go through the template even when string prompts do not.
    plain = load_prompts(DataConfig(), tokenizer, path)
    assert plain[0].text == "ab="
    assert plain[1].text == "<|im_start|>user:cd=<|im_end|><|im_start|>assistant:"
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert plain[1].input_ids[0] == im_start and tokenizer.eos_token_id not in plain[1].input_ids


def test_custom_keys_label_types_and_metadata_pass_through(tmp_path, tokenizer):
    path = write_lines(
        tmp_path / "keys.jsonl",
        [
            json.dumps({"q": "ab=", "a": 2, "m": {"choices": ["x", "y", "z"]}}),
            json.dumps({"q": "cd=", "a": ["d", "c"]}),
        ],
    )
    prompts = load_prompts(DataConfig(prompt_key="q", label_key="a", metadata_key="m"), tokenizer, path)
    assert [(p.label, p.metadata) for p in prompts] == [(2, {"choices": ["x", "y", "z"]}), (["d", "c"], {})]


LONG_PROMPT = "a" * 9


@pytest.mark.parametrize(
    "content, reason",
    [
        (b'{"prompt": "ab=", "label": ', "invalid JSON (Expecting value at column 28)"),
        (b'["ab=", "ba"]', "expected a JSON object, got array"),
        (b'{"label": "ba"}', "missing key 'prompt'"),
        (b'{"prompt": "  ", "label": "ba"}', "empty 'prompt'"),
        (b'{"prompt": [], "label": "ba"}', "empty 'prompt' (no messages)"),
        (b'{"prompt": "ab="}', "missing or null 'label'"),
        (b'{"prompt": "ab=", "label": null}', "missing or null 'label'"),
        (b'{"prompt": 3, "label": "ba"}', "must be a string or a list of messages, got number"),
        (b'{"prompt": [{"role": "user"}], "label": "ba"}', "message 0 is not a {role, content} object"),
        (b'{"prompt": [{"role": "user", "content": 1}], "label": "ba"}', "message 0 is not a {role, content} object"),
        (b'{"prompt": "ab=", "label": "ba", "metadata": [1]}', "'metadata' must be a JSON object, got array"),
        (b'{"prompt": "ab\xff=", "label": "ba"}', "not UTF-8"),
        (b'{"prompt": "' + LONG_PROMPT.encode() + b'", "label": "ba"}', "9 tokens, more than data.max_prompt_len=8"),
        (b'{"prompt": "AB=", "label": "ba"}', "the tokenizer cannot encode the prompt"),
        (b"", "empty line"),
    ],
)
def test_malformed_row_names_file_line_and_reason(tmp_path, tokenizer, content, reason):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(GOOD_ROW.encode() + b"\n" + content + b"\n" + GOOD_ROW.encode() + b"\n")
    with pytest.raises(DatasetError) as caught:
        load_prompts(DataConfig(max_prompt_len=8), tokenizer, path)
    message = str(caught.value)
    assert message.startswith(f"{path}:2: ")
    assert reason in message
    assert caught.value.line == 2


def test_empty_file_is_an_error(tmp_path, tokenizer):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    with pytest.raises(DatasetError, match="has no rows"):
        load_prompts(DataConfig(), tokenizer, path)


def test_parquet_without_pyarrow_says_how_to_fix(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(DatasetError, match="pip install pyarrow"):
        load_prompts(DataConfig(), tokenizer, path)


def test_parquet_rows_load_like_jsonl_rows(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [
        {"prompt": "ab=", "label": "ba", "metadata": {"task": "reversal"}},
        {"prompt": "cd=", "label": "dc", "metadata": {"task": "reversal"}},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    jsonl = write_lines(tmp_path / "rows.jsonl", [json.dumps(row) for row in rows])
    from_parquet = load_prompts(DataConfig(), tokenizer, tmp_path / "rows.parquet")
    assert from_parquet == load_prompts(DataConfig(), tokenizer, jsonl)

    bad_rows = [rows[0], {"prompt": "", "label": "x", "metadata": {"task": "r"}}]
    pq.write_table(pa.Table.from_pylist(bad_rows), tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad\.parquet:2: empty 'prompt'"):
        load_prompts(DataConfig(), tokenizer, tmp_path / "bad.parquet")


def test_a_byte_order_mark_opening_a_jsonl_file_is_accepted(tmp_path, tokenizer):
    rows = [GOOD_ROW, json.dumps({"prompt": "cd=", "label": "dc"})]
    plain = write_lines(tmp_path / "plain.jsonl", rows)
    with_bom = tmp_path / "bom.jsonl"
    with_bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert load_prompts(DataConfig(), tokenizer, with_bom) == load_prompts(DataConfig(), tokenizer, plain)


def test_a_byte_order_mark_inside_a_jsonl_file_is_refused_saying_so(tmp_path, tokenizer):
    path = tmp_path / "joined.jsonl"
    path.write_bytes(GOOD_ROW.encode() + b"\n\xef\xbb\xbf" + GOOD_ROW.encode() + b"\n")
    with pytest.raises(DatasetError, match=r"joined\.jsonl:2: a UTF-8 byte-order mark inside the file"):
        load_prompts(DataConfig(), tokenizer, path)


@pytest.mark.parametrize(
    "column, value, reason",
    [
        ("metadata", {"created": datetime.datetime(2024, 5, 1, 12, 0)}, "metadata.created is a datetime"),
        ("label", decimal.Decimal("2.50"), "label is a Decimal ('2.50'), not JSON data"),
        ("metadata", {"choices": [b"4 m/s", b"8 m/s"]}, "metadata.choices[0] is a bytes"),
    ],
    ids=["timestamp-in-metadata", "decimal-label", "binary-in-a-list"],
)
def test_parquet_values_that_are_not_json_data_are_refused_at_load_naming_file_and_row(
    tmp_path, tokenizer, column, value, reason
):
    """Refused, not converted: a reward receives JSON data, and a timestamp or a decimal has no one JSON form."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    good = {"prompt": "ab=", "label": "ba", "metadata": {"task": "reversal"}}
    pq.write_table(pa.Table.from_pylist([{**good, column: value}] * 2), tmp_path / "rows.parquet")
    with pytest.raises(DatasetError, match=r"rows\.parquet:1: ") as caught:
        load_prompts(DataConfig(), tokenizer, tmp_path / "rows.parquet")
    assert reason in str(caught.value) and "Cast the column" in str(caught.value)


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"path": "rows.csv"}, "data.path='rows.csv' must end in .jsonl or .parquet"),
        ({"path": "missing.jsonl"}, "data.path='missing.jsonl' is not a file"),
        ({"max_prompt_len": 0}, "data.max_prompt_len=0"),
        ({"system_prompt": "be brief"}, "data.apply_chat_template=true"),
    ],
)
def test_data_config_names_the_bad_key(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.").replace("(", r"\(")):
        DataConfig(**overrides)


def test_data_config_binds_from_yaml_overrides():
    merged = OmegaConf.merge(
        OmegaConf.structured(DataConfig), OmegaConf.from_dotlist(["shuffle=false", "task.length=5"])
    )
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, DataConfig) and isinstance(cfg.task, ReversalTaskConfig)
    assert (cfg.shuffle, cfg.task.length, cfg.path) == (False, 5, None)


# ---- the prompt source -------------------------------------------------------------------------


def test_prompt_source_gives_every_prompt_once_per_epoch():
    source = PromptSource(make_prompts(10), shuffle=True, seed=3)
    handed_out = [p.index for _ in range(10) for p in source.next_batch(3)]  # 30 prompts: 3 epochs
    epochs = [handed_out[0:10], handed_out[10:20], handed_out[20:30]]
    for order in epochs:
        assert sorted(order) == list(range(10))
    assert epochs[0] != epochs[1] and epochs[0] != list(range(10))
    assert source.epoch == 2


def test_prompt_source_without_shuffle_keeps_file_order():
    source = PromptSource(make_prompts(5), shuffle=False, seed=3)
    assert [p.index for p in source.next_batch(7)] == [0, 1, 2, 3, 4, 0, 1]


def test_prompt_order_depends_only_on_seed():
    def order(seed):
        return [p.index for p in PromptSource(make_prompts(20), shuffle=True, seed=seed).next_batch(40)]

    assert order(1) == order(1)
    assert order(1) != order(2)


def test_given_back_prompts_come_first():
    source = PromptSource(make_prompts(10), shuffle=False, seed=0)
    first = source.next_batch(4)
    source.give_back([first[3], first[1]])
    assert [p.index for p in source.next_batch(3)] == [3, 1, 4]
    source.give_back(source.next_batch(2))
    assert [p.index for p in source.next_batch(1)] == [5]
    assert [p.index for p in source.next_batch(6)] == [6, 7, 8, 9, 0, 1]


def test_prompt_source_resumes_where_it_stopped():
    prompts = make_prompts(7)
    source = PromptSource(prompts, shuffle=True, seed=5)
    source.next_batch(5)
    source.next_batch(4)  # crosses into epoch 1
    source.give_back(source.next_batch(2))
    state = json.loads(json.dumps(source.state_dict()))

    resumed = PromptSource(prompts, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    expected = [p.index for p in source.next_batch(20)]
    assert [p.index for p in resumed.next_batch(20)] == expected


def test_prompt_source_refuses_a_checkpoint_of_another_data_set():
    state = PromptSource(make_prompts(7), shuffle=True, seed=5).state_dict()
    with pytest.raises(ValueError, match="had 7 prompts, the data set has 8"):
        PromptSource(make_prompts(8), shuffle=True, seed=5).load_state_dict(state)


def test_peek_shows_the_next_batch_without_handing_it_out():
    """rollout.speculative drafts the next step's prompts: across an epoch's end and with prompts given back, a peek
    is exactly what the next draw hands out, and the draw after a peek is unchanged."""
    peeked, plain = PromptSource(make_prompts(7), shuffle=True, seed=5), PromptSource(make_prompts(7), shuffle=True,
                                                                                          seed=5)
    for source in (peeked, plain):
        source.give_back(source.next_batch(5)[3:])
    for n in (3, 6, 4):  # the second crosses into the next epoch
        ahead = peeked.peek(n)
        assert peeked.peek(n) == ahead
        assert peeked.next_batch(n) == ahead == plain.next_batch(n)
    assert peeked.state_dict() == plain.state_dict()
