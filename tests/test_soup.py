"""Model soups (a phase with `average`, tasks/soup.py): what the plan makes of one and which versions
it moves, the errors of a soup that cannot be made, the soup step's mean against one computed
here, and a soup config run end to end: the soups' parameters are their parts' mean, each is
evaluated, `kiln compare` shows a row per soup, and the export and `kiln generate` take one."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from flows.canary import results
from flows.config import ExperimentConfig
from flows.experiment import from_config
from tasks.engine.config import ConfigModel
from tasks.engine.step import Step, StepContext
from tasks.engine.store import Store
from tasks.soup import GreedySelection, run_soup, soup_step
from tests.conftest import kiln
from tests.test_phases import BASE, steps_of
from tests.test_scheduler import run_names
from training.config import KEPT_DIR, ModelConfig

SOUP = {**BASE, "name": "souped",
        "train": {"batch_size": 4, "steps": 20, "warmup": 2, "schedule": "wsd", "decay_steps": 5,
                  "checkpoint_every": 10, "log_every": 5, "eval_every": 10, "eval_batches": 1},
        "phases": {"anneal": {"from": "train", "step": 15, "steps": 5, "train": {"seed": 1}},
                   "stable": {"average": ["train@10", "train@15"]},
                   "soup": {"average": ["train", "anneal"]}}}


def test_a_soup_phase_averages_the_steps_it_names_and_moves_no_other_version():
    steps = steps_of(SOUP)
    train, anneal, stable, soup = (steps[n] for n in ("train", "train/anneal", "train/stable", "train/soup"))
    assert (soup.stage, stable.stage) == ("soup", "soup")
    assert (soup.inputs["part/0"], soup.inputs["part/1"], soup.config.steps) == (train, anneal, (None, None))
    assert (stable.inputs["part/0"], stable.inputs["part/1"], stable.config.steps) == (train, train, (10, 15))
    assert train.config.train.keep_checkpoints == (10, 15)  # the anneal's start and the stable soup's parts
    assert steps["export"].inputs["model"] is soup  # the last phase is what the export takes
    assert steps["evaluate/soup"].inputs["model"] is soup and steps["evaluate/stable"].inputs["model"] is stable

    # what a train output keeps is a setting: adding soups moves no train step's version
    plain = steps_of({**SOUP, "phases": {"anneal": SOUP["phases"]["anneal"]}})
    assert plain["train"].version == train.version and plain["train/anneal"].version == anneal.version
    assert plain["train"].config.train.keep_checkpoints == (15,)
    # a part's change moves the soups of it only; the parts' order is part of the version
    moved = steps_of({**SOUP, "phases": {**SOUP["phases"], "anneal": {**SOUP["phases"]["anneal"],
                                                                      "train": {"seed": 2}}}})
    assert moved["train/soup"].version != soup.version and moved["train/stable"].version == stable.version
    swapped = steps_of({**SOUP, "phases": {**SOUP["phases"], "soup": {"average": ["anneal", "train"]}}})
    assert swapped["train/soup"].version != soup.version

    # eval.checkpoints evaluates the last phase that trains: a soup keeps no steps
    series = steps_of({**SOUP, "eval": {**SOUP["eval"], "checkpoints": [20]}})
    assert series["evaluate/anneal/step-20"].inputs["model"].name == "train/anneal"


def test_another_experiment_starts_from_a_published_soup_in_mode_weights_only():
    soup = "soup/0123456789ab"
    steps = steps_of({**BASE, "train": {**BASE["train"], "init": {"from": soup, "mode": "weights"}}})
    assert (steps["train"].inputs["init"].stage, steps["train"].inputs["init"].version) == ("soup", "0123456789ab")
    for init in ({"from": soup}, {"from": soup, "mode": "reset"}, {"from": soup, "mode": "weights", "step": 10}):
        with pytest.raises(ValueError, match="is a soup, an average of parameters with no train state"):
            steps_of({**BASE, "train": {**BASE["train"], "init": init}})


GREEDY = {**SOUP, "phases": {**{k: v for k, v in SOUP["phases"].items() if k != "soup"},
                              "greedy": {"average": ["train@10", "train", "anneal"], "greedy": True},
                              "soup": SOUP["phases"]["soup"]}}  # the soup stays last: the export's model


def test_a_greedy_soup_reads_the_held_out_tokens_after_the_evaluated_ones():
    steps, uniform = steps_of(GREEDY), steps_of(SOUP)
    greedy, heldout = steps["train/greedy"], SOUP["eval"]["heldout_tokens"]
    assert (greedy.inputs["tokens"], greedy.inputs["tokenizer"]) == (steps["tokenize"], steps["tokenizer"])
    assert (greedy.config.greedy, greedy.config.select_from, greedy.config.select_tokens) == (True, heldout, heldout)
    assert greedy.config.steps == (10, None, None) and steps["export"].inputs["model"] is steps["train/soup"]
    # adding it moves no other version; a uniform soup of the same parts is another version
    assert all(steps[n].version == uniform[n].version for n in uniform)
    same_parts = steps_of({**GREEDY, "phases": {**GREEDY["phases"], "greedy": {"average": ["train@10", "train",
                                                                                         "anneal"]}}})
    assert same_parts["train/greedy"].version != greedy.version and "tokens" not in same_parts["train/greedy"].inputs
    with pytest.raises(ValueError, match="greedy chooses among a soup's parts: give `average`"):
        steps_of({**SOUP, "phases": {"anneal": {**SOUP["phases"]["anneal"], "greedy": True}}})
    with pytest.raises(ValueError, match="with eval.heldout_tokens unset it scores them all: set it"):
        steps_of({**GREEDY, "eval": {k: v for k, v in GREEDY["eval"].items() if k != "heldout_tokens"}})


def heldout_alone(folder, store, steps, soup_config) -> float:
    """A model folder's loss on the held-out tokens a greedy soup scores, computed here."""
    from evaluation.perplexity import heldout_metrics
    from tasks.tokenizer import load_tokenizer
    from training.data import TokenDataset
    from training.loop import load_model

    cfg, params = load_model(folder)
    dataset = TokenDataset(store / "tokenize" / steps["tokenize"].version, "validation")
    tokenizer = load_tokenizer(store / "tokenizer" / steps["tokenizer"].version)
    return heldout_metrics(cfg, params, dataset, tokenizer, soup_config.batch_size, soup_config.select_tokens,
                           first_token=soup_config.select_from)["loss"]


def test_a_soup_config_branches_into_variants_and_travels_as_a_deployment_parameter():
    """A branch's config and a deployment's parameters are the config dumped whole and validated
    again: a soup phase then has every field, at its default, and is still a soup."""
    config = ExperimentConfig.model_validate({**SOUP, "variants": {"a": {}, "b": {"train.lr": 1.0e-3}}})
    experiment = from_config(config)
    assert sorted(s.name for s in experiment.steps if s.stage == "soup") == [
        "train/soup/a", "train/soup/b", "train/stable/a", "train/stable/b"]
    dumped = ExperimentConfig.model_validate(SOUP).model_dump(mode="json")
    assert ExperimentConfig.model_validate(dumped) == ExperimentConfig.model_validate(SOUP)
    with pytest.raises(ValueError, match="trains nothing: leave out mode"):  # a value away from its default
        ExperimentConfig.model_validate({**dumped, "phases": {**dumped["phases"],
                                                              "soup": {**dumped["phases"]["soup"], "mode": "reset"}}})


@pytest.mark.parametrize("phases, error", [
    ({"s": {"average": ["train"]}}, "two or more"),
    ({"s": {"average": ["train", "train"]}}, "two or more"),
    ({"s": {"average": ["train", "later"]}, "later": {"steps": 5}}, "'later' is not `train` or a phase before"),
    ({"a": {"steps": 5}, "s": {"average": ["train", "a"], "steps": 3}}, "trains nothing: leave out steps"),
    ({"a": {"steps": 5}, "s": {"average": ["train", "a"], "from": "a", "mode": "weights"}}, "leave out from, mode"),
    ({"a": {"steps": 5}, "s": {"average": ["train@x", "a"]}}, "'train@x' is not `<phase>` or `<phase>@<step>`"),
    ({"a": {"steps": 5}, "s": {"average": ["train@30", "a"]}}, r"train@30 is not a step train trains \(1 to 20\)"),
    ({"a": {"from": "train", "step": 10, "steps": 5}, "s": {"average": ["a@8", "train"]}},
     r"a@8 is not a step train/a trains \(11 to 15\)"),
    ({"a": {"steps": 5}, "s": {"average": ["train", "a"]}, "t": {"average": ["s", "a"]}}, "'s' is a soup itself"),
    ({"a": {"steps": 5}, "s": {"average": ["train", "a"]}, "b": {"steps": 5}}, "'s' is a soup, an average"),
    ({"a": {"steps": 5}, "s": {"average": ["train", "a"]}, "b": {"from": "s", "steps": 5}}, "'s' is a soup"),
    ({"a": {}}, "a phase trains `steps` steps"),
])
def test_a_soup_that_cannot_be_made_is_refused_naming_why(phases, error):
    with pytest.raises(ValueError, match=error):
        ExperimentConfig.model_validate({**SOUP, "phases": phases}).phase_trains()


def _model(folder, cfg: ModelConfig, params: dict) -> None:
    from training.loop import save_model

    save_model(folder, cfg, params)


def _soup(tmp_path, parts: list, steps: list, greedy: bool = False) -> tuple[dict, dict]:
    """Run the soup step's body on model folders; its stats and parameters. `greedy`: a greedy soup
    whose held-out tokens and tokenizer are not there (for what it says before it reads them)."""
    named = [Step(f"train/{i}", "train", 1, ConfigModel(), lambda ctx: {}) for i in range(len(parts))]
    data = [Step(name, name, 1, ConfigModel(), lambda ctx: {}) for name in ("tokenize", "tokenizer")]
    step = soup_step(list(zip(named, steps)), GreedySelection(*data, first_token=0, tokens=8) if greedy else None)
    out = tmp_path / "soup"
    out.mkdir()
    inputs = {f"part/{i}": p for i, p in enumerate(parts)}
    if greedy:
        inputs.update(tokens=tmp_path / "no-tokens", tokenizer=tmp_path / "no-tokenizer")
    ctx = StepContext(step=step, out=out, inputs=inputs, input_stats={},
                      work_dir=tmp_path / "work", log=logging.getLogger("test"))
    stats = run_soup(ctx)
    assert ModelConfig.model_validate_json((out / "model.json").read_text()) == ModelConfig.model_validate_json(
        (parts[0] / "model.json").read_text())
    return stats, load_file(str(out / "params.safetensors"))


def test_the_soup_step_writes_the_mean_of_its_parts(tmp_path):
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, seq_len=32, vocab_size=64)
    rng = np.random.default_rng(0)
    parts = [{"embed": rng.normal(size=(64, 32)).astype(np.float32), "norm": rng.normal(size=32).astype(np.float32)}
             for _ in range(3)]
    folders = [tmp_path / f"part{i}" for i in range(3)]
    for folder, params in zip(folders, parts):
        _model(folder, cfg, params)
    _model(folders[2] / KEPT_DIR / "10", cfg, parts[0])  # a kept step of the third: the first's parameters

    stats, soup = _soup(tmp_path, folders, [None, None, None])
    for key in ("embed", "norm"):
        mean = sum(p[key].astype(np.float64) for p in parts) / 3
        assert soup[key].dtype == np.float32 and np.array_equal(soup[key], mean.astype(np.float32))
    mean = {k: sum(p[k].astype(np.float64) for p in parts) / 3 for k in parts[0]}
    spread = math.sqrt(sum(np.sum((p[k] - mean[k]) ** 2) for p in parts for k in p) / 3) / math.sqrt(
        sum(np.sum(m ** 2) for m in mean.values()))
    assert stats["spread"] == pytest.approx(spread, rel=1e-5) and stats["param_count"] == 64 * 32 + 32
    assert [p["step"] for p in stats["parts"]] == ["train/0", "train/1", "train/2"]

    (tmp_path / "soup").rename(tmp_path / "first")
    stats, soup = _soup(tmp_path, folders[1:], [None, 10])  # the third at its kept step 10
    assert np.array_equal(soup["norm"], ((parts[1]["norm"].astype(np.float64) + parts[0]["norm"]) / 2)
                          .astype(np.float32))
    assert stats["parts"][1]["kept_step"] == 10

    (tmp_path / "soup").rename(tmp_path / "second")
    with pytest.raises(FileNotFoundError, match="kept no parameters at step 20"):
        _soup(tmp_path, folders[1:], [None, 20])
    other = tmp_path / "wider"
    _model(other, cfg.model_copy(update={"d_ff": 128}), parts[0])
    (tmp_path / "soup").rmdir()
    with pytest.raises(ValueError, match="differs from .* in d_ff"):
        _soup(tmp_path, [folders[0], other], [None, None])
    fewer = tmp_path / "fewer"
    _model(fewer, cfg, {"embed": parts[0]["embed"]})
    (tmp_path / "soup").rmdir()
    with pytest.raises(ValueError, match="holds other parameters"):
        _soup(tmp_path, [folders[0], fewer], [None, None])
    (tmp_path / "soup").rmdir()
    with pytest.raises(ValueError, match="holds other parameters"):  # a greedy soup: before it scores any
        _soup(tmp_path, [folders[0], fewer], [None, None], greedy=True)


@pytest.mark.slow  # a kiln run that trains (~25 s alone); CI runs it after the fast suite
@pytest.mark.ci
@pytest.mark.ray  # its training starts a local Ray: tests/conftest.py ray_lock
def test_a_soup_config_runs_end_to_end_and_every_soup_is_its_parts_mean(tmp_path):
    config, store = tmp_path / "soup.yaml", tmp_path / "store"
    config.write_text(yaml.safe_dump(SOUP, sort_keys=False))
    ran = run_names(kiln("run", str(config), "--store", str(store)).stdout)
    assert all(ran[n] == "ran" for n in ("train", "train/anneal", "train/stable", "train/soup", "evaluate/soup",
                                         "evaluate/stable", "export")), ran
    steps = steps_of(SOUP)

    def params(step, kept=None):
        folder = store / step.stage / step.version
        return load_file(str((folder if kept is None else folder / KEPT_DIR / str(kept)) / "params.safetensors"))

    for soup, parts in (("train/soup", [params(steps["train"]), params(steps["train/anneal"])]),
                        ("train/stable", [params(steps["train"], 10), params(steps["train"], 15)])):
        made = params(steps[soup])
        assert set(made) == set(parts[0])
        for key, value in made.items():
            mean = (parts[0][key].astype(np.float64) + parts[1][key]) / 2
            assert np.array_equal(value, mean.astype(np.float32)), (soup, key)
        assert not np.array_equal(parts[0][key], parts[1][key])  # two models, not one twice

    rows = {r["variant"]: r for r in json.loads(kiln("compare", str(config), "--store", str(store), "--json").stdout)}
    assert list(rows) == ["train", "anneal", "stable", "soup"]
    assert all(r["status"] == "done" and r["bits_per_byte"] > 0 for r in rows.values())
    assert rows["soup"]["final_loss"] == "-" and rows["soup"]["params"] == rows["train"]["params"]
    assert rows["soup"]["train_version"] == steps["train/soup"].version
    # the canary's bounds: the last train step's stats, the final model's (the last soup's) evaluation
    checked = results(from_config(ExperimentConfig.model_validate(SOUP)), Store(str(store)))["souped"]
    assert checked["final_loss"] == rows["anneal"]["final_loss"]
    assert checked["bits_per_byte"] == rows["soup"]["bits_per_byte"] != rows["anneal"]["bits_per_byte"]

    assert rows["soup"]["soup_parts"] == 2 and rows["train"]["soup_parts"] == "-"

    # a greedy soup on the same store: each part scored alone on the held-out tokens after the
    # evaluated ones, the best first, the others kept only where the soup's loss did not rise
    config.write_text(yaml.safe_dump(GREEDY, sort_keys=False))
    ran = run_names(kiln("run", str(config), "--store", str(store)).stdout)
    assert ran["train/greedy"] == "ran" and ran["train"] == "cached" and ran["export"] == "cached"
    greedy = steps_of(GREEDY)["train/greedy"]
    stats = json.loads((store / "soup" / greedy.version / "lineage.json").read_text())["stats"]
    folders = [store / "train" / steps["train"].version / KEPT_DIR / "10", store / "train" / steps["train"].version,
               store / "train" / steps["train/anneal"].version]
    alone = [heldout_alone(folder, store, steps, greedy.config) for folder in folders]
    trace = stats["greedy"]
    assert [t["part"] for t in trace][0] == int(np.argmin(alone)) and sorted(t["part"] for t in trace) == [0, 1, 2]
    best = math.inf
    for t in trace:
        assert t["loss"] == pytest.approx(alone[t["part"]], abs=2e-6)
        assert t["kept"] == (t["soup_loss"] <= best)
        best = min(best, t["soup_loss"]) if t["kept"] else best
    kept = sorted(t["part"] for t in trace if t["kept"])
    assert stats["kept_parts"] == len(kept)
    made = load_file(str(store / "soup" / greedy.version / "params.safetensors"))
    parts = [load_file(str(folders[i] / "params.safetensors")) for i in kept]
    for key, value in made.items():
        assert np.array_equal(value, (sum(p[key].astype(np.float64) for p in parts) / len(parts)).astype(np.float32))
    rows = {r["variant"]: r for r in json.loads(kiln("compare", str(config), "--store", str(store), "--json").stdout)}
    assert rows["greedy"]["soup_parts"] == len(kept) and rows["greedy"]["bits_per_byte"] > 0
    config.write_text(yaml.safe_dump(SOUP, sort_keys=False))

    export = store / "export" / steps["export"].version
    assert "averaged (a model soup)" in (export / "README.md").read_text()
    out = kiln("generate", str(store / "soup" / steps["train/soup"].version), "--prompt", "In the beginning",
               "--max-tokens", "8", "--temperature", "0").stdout
    assert out.strip()  # text: the soup's tokenizer found through its lineage

    # another experiment starts from the soup's parameters (train.init.from: soup/<version>, mode weights)
    onward = {**BASE, "name": "onward", "train": {**BASE["train"], "steps": 4, "warmup": 1,
                                                   "init": {"from": f"soup/{steps['train/soup'].version}",
                                                            "mode": "weights"}}}
    config.write_text(yaml.safe_dump(onward, sort_keys=False))
    assert run_names(kiln("run", str(config), "--store", str(store), "--until", "train").stdout)["train"] == "ran"
    lineage = json.loads((store / "train" / steps_of(onward)["train"].version / "lineage.json").read_text())
    assert {"stage": "soup", "version": steps["train/soup"].version} in [
        {k: i[k] for k in ("stage", "version")} for i in lineage["inputs"]]

    # a soup that names a step the trained run did not keep: the plan says so before anything runs
    unkept = {**SOUP, "phases": {**SOUP["phases"], "stable": {"average": ["train@12", "train"]}}}
    config.write_text(yaml.safe_dump(unkept, sort_keys=False))
    planned = kiln("plan", str(config), "--store", str(store))
    assert "train/stable needs step 12 of train" in planned.stderr and "it kept [10, 15]" in planned.stderr
