"""Held-out evaluation (livemoe.train.evaluate): sampled responses are independent across requests and
reproducible, `samples` responses per prompt are all judged, greedy refuses several samples."""
import pytest
import torch

from livemoe.engine.model.loader import load_model, load_tokenizer
from test_rollout import make_student
from livemoe.train.config import ConfigError, parse_config
from livemoe.train.rft.config import RFTConfig
from livemoe.train.evaluate import evaluate
from livemoe.train.judges import load_judge
from livemoe.train.synthetic import make_rooms

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/fixtures.py: tiny matmuls, shared CPU


@pytest.fixture(scope="module")
def model_and_tok(tmp_path_factory):
    path = make_student(tmp_path_factory.mktemp("student") / "ckpt")
    return load_model(path, dtype=torch.float32, device="cpu"), load_tokenizer(path)


def run(model_and_tok, records, **kw):
    model, tok = model_and_tok
    return evaluate(model, tok, records, load_judge("synthetic"), max_new_tokens=12, progress=False, **kw)


def texts(row):
    return [s["completion"] for s in row["samples"]]


def test_identical_prompts_get_independent_samples(model_and_tok):
    # one seed shared by every request would give these six copies of one prompt the same noise, hence
    # the same text six times: a correlated sample that says nothing about the distribution
    records = [make_rooms(1, seed=3)[0]] * 6
    row = run(model_and_tok, records, temperature=1.0, seed=0)
    assert len(set(texts(row))) > 1
    assert texts(run(model_and_tok, records, temperature=1.0, seed=0)) == texts(row)  # reproducible
    assert texts(run(model_and_tok, records, temperature=1.0, seed=1)) != texts(row)


def test_every_sample_of_every_prompt_is_judged(model_and_tok):
    records = make_rooms(3, seed=5)
    row = run(model_and_tok, records, temperature=1.0, samples=4)
    assert (row["prompts"], row["n"], len(row["samples"]), row["samples_per_prompt"]) == (3, 12, 12, 4)
    assert [s["id"] for s in row["samples"]] == [r["id"] for r in records for _ in range(4)]
    assert len(set(texts(row)[:4])) > 1  # a prompt's samples differ
    assert 0 < row["tpr"] <= 12


def test_greedy_is_one_response_per_prompt(model_and_tok):
    records = make_rooms(2, seed=7)
    row = run(model_and_tok, records, temperature=0.0)
    assert row["n"] == 2 and texts(row) == texts(run(model_and_tok, records, temperature=0.0, seed=9))
    with pytest.raises(ValueError, match="needs temperature > 0"):
        run(model_and_tok, records, temperature=0.0, samples=2)


def test_config_rejects_several_greedy_samples():
    assert parse_config(RFTConfig, ["--eval_temperature", "0", "--eval_samples", "1"]).eval_samples == 1
    with pytest.raises(ConfigError, match="--eval_samples 4 needs --eval_temperature > 0"):
        parse_config(RFTConfig, ["--eval_temperature", "0"])
    with pytest.raises(ConfigError, match="--eval_samples must be >= 1"):
        parse_config(RFTConfig, ["--eval_samples", "0"])
