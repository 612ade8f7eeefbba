"""An export evaluated by lm-eval's own `hf` model (transformers on torch, CPU) scores kiln's offline
suite task as kiln's adapter scores the JAX model: the same accuracy, the same log-likelihoods;
and a task that generates gets the same greedy answers from both. A random-init model (large
init, so answers differ) over the BPE tokenizer trained on the KJV."""

from __future__ import annotations

import json

import jax
import lm_eval
import pytest
import yaml
from lm_eval.tasks import TaskManager

from evaluation.adapter import KilnLM
from evaluation.suite import SuiteConfig, build_suite, task_configs
from tasks.tokenizer import load_tokenizer, read_tokenizer_meta
from tests.test_eval_adapter import CFG
from tests.test_eval_data import kjv_data  # noqa: F401  (a fixture)
from training.export import export_hf
from training.model import init_params
from tests.conftest import needs

needs("torch")
needs("accelerate")  # lm-eval's hf model imports it


def scores(model, model_args: str | None, tasks, limit: int, **options) -> tuple[float, list[list[float]]]:
    """(accuracy, per example the log-likelihood of each choice)."""
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, limit=limit,
                                      bootstrap_iters=0, log_samples=True, batch_size=8, **options)
    (name,) = results["results"]
    samples = sorted(results["samples"][name], key=lambda s: s["doc_id"])
    return results["results"][name]["acc,none"], [[r[0] for r in s["filtered_resps"]] for s in samples]


def exported(kjv_data, tmp_path, chat_template: str | None = None) -> tuple[dict, dict, object]:  # noqa: F811
    """(tokenizer meta, the random-init parameters, their export folder)."""
    meta = read_tokenizer_meta(kjv_data.tokenizer)
    params = jax.jit(init_params, static_argnums=0)(CFG, jax.random.PRNGKey(1))
    export = tmp_path / "export"
    export.mkdir()
    export_hf(CFG, params, (kjv_data.tokenizer / "tokenizer.json").read_text(), meta, export, chat_template)
    return meta, params, export


def test_lm_eval_hf_on_the_export_matches_kiln_adapter(kjv_data, tmp_path):  # noqa: F811
    meta, params, export = exported(kjv_data, tmp_path)
    build_suite(kjv_data.held_out(), tmp_path / "suite", ["next_passage"], SuiteConfig(context_words=24, choice_words=8))

    def tasks():  # fresh task objects for each model
        manager = TaskManager(include_defaults=False)
        return list(manager.load(task_configs(tmp_path / "suite", ["next_passage"]))["tasks"].values())

    kiln_lm = KilnLM(CFG, params, load_tokenizer(kjv_data.tokenizer), meta["eos_id"], meta.get("bos_id"), batch_size=8)
    kiln_acc, kiln_ll = scores(kiln_lm, None, tasks(), limit=40)
    hf_acc, hf_ll = scores("hf", f"pretrained={export},device=cpu,dtype=float32", tasks(), limit=40)

    assert len(kiln_ll) == len(hf_ll) == 40
    assert hf_acc == kiln_acc
    for ours, theirs in zip(kiln_ll, hf_ll):
        assert theirs == pytest.approx(ours, rel=1e-4, abs=1e-3)
    assert len({tuple(round(x, 3) for x in ll) for ll in kiln_ll}) > 30  # real, differing scores


def test_a_generating_task_gets_the_same_greedy_answers_from_export_and_adapter(kjv_data, tmp_path):  # noqa: F811
    """generate_until: kiln's batched, KV-cached greedy decoding against transformers' `generate`
    on the export (left-padded batches of 8 on both sides), cut at the same stop string."""
    meta, params, export = exported(kjv_data, tmp_path)
    rows = [{"context": " ".join(doc["text"].split()[:16]), "target": " ".join(doc["text"].split()[16:20])}
            for doc in kjv_data.held_out()[:24]]
    (tmp_path / "continue.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {"task": "kjv_continue", "dataset_path": "json", "test_split": "test",
            "dataset_kwargs": {"data_files": {"test": str(tmp_path / "continue.jsonl")}},
            "output_type": "generate_until", "doc_to_text": "context", "doc_to_target": "target",
            "generation_kwargs": {"until": ["."], "max_gen_toks": 12, "do_sample": False},
            "metric_list": [{"metric": "exact_match"}], "metadata": {"version": 1}}
    (tmp_path / "continue.yaml").write_text(yaml.safe_dump(task))

    def answers(model, model_args: str | None) -> list[str]:
        manager = TaskManager(include_defaults=False, include_path=str(tmp_path))
        results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["kjv_continue"],
                                          task_manager=manager, bootstrap_iters=0, log_samples=True, batch_size=8)
        return [s["resps"][0][0] for s in sorted(results["samples"]["kjv_continue"], key=lambda s: s["doc_id"])]

    kiln_lm = KilnLM(CFG, params, load_tokenizer(kjv_data.tokenizer), meta["eos_id"], meta.get("bos_id"), batch_size=8)
    ours = answers(kiln_lm, None)
    theirs = answers("hf", f"pretrained={export},device=cpu,dtype=float32")
    assert len(ours) == 24 and len(set(ours)) > 12  # real, differing answers
    assert theirs == ours


# a template whose turns end in the EOS token's string: it must be read as that token on both sides
TURNS = ("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
         "{% if add_generation_prompt %}### assistant:\n{% endif %}")


def test_lm_eval_with_the_chat_template_on_the_export_matches_kiln_adapter(kjv_data, tmp_path):  # noqa: F811
    """lm-eval's apply_chat_template: its hf model renders each prompt with the export's template
    (transformers), kiln's adapter with the same template (training/chat_jinja.py): the same
    accuracy and log-likelihoods, which differ from the plain prompts'."""
    from training.chat_jinja import CheckpointTemplate, checkpoint_template

    meta, params, export = exported(kjv_data, tmp_path, TURNS)
    build_suite(kjv_data.held_out(), tmp_path / "suite", ["next_passage"], SuiteConfig(context_words=24, choice_words=8))

    def tasks():
        manager = TaskManager(include_defaults=False)
        return list(manager.load(task_configs(tmp_path / "suite", ["next_passage"]))["tasks"].values())

    tokenizer = load_tokenizer(kjv_data.tokenizer)
    source, special = checkpoint_template(export)
    chat = CheckpointTemplate(source, tokenizer, special)
    kiln_lm = KilnLM(CFG, params, tokenizer, meta["eos_id"], meta.get("bos_id"), batch_size=8, chat=chat)
    kiln_acc, kiln_ll = scores(kiln_lm, None, tasks(), limit=24, apply_chat_template=True)
    hf_acc, hf_ll = scores("hf", f"pretrained={export},device=cpu,dtype=float32", tasks(), limit=24,
                           apply_chat_template=True)
    plain = KilnLM(CFG, params, tokenizer, meta["eos_id"], meta.get("bos_id"), batch_size=8)
    _, plain_ll = scores(plain, None, tasks(), limit=24)

    assert len(kiln_ll) == len(hf_ll) == 24 and hf_acc == kiln_acc
    for ours, theirs in zip(kiln_ll, hf_ll):
        assert theirs == pytest.approx(ours, rel=1e-4, abs=1e-3)
    assert all(abs(a - b) > 1e-3 for ours, flat in zip(kiln_ll, plain_ll) for a, b in zip(ours, flat))
