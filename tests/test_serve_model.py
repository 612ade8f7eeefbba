"""`kiln serve-model` on the tiny model tests/test_generate.py trains (its tokenizer has the chat
tokens), served on 127.0.0.1: lm-eval's own `local-completions` model scores a local task through
it with the in-process adapter's log-likelihoods; the openai client gets completions and chat
completions; greedy text is `evaluation.generate`'s; a prompt's tokens are the same alone and
decoding beside others; a short request is answered while a long answer decodes (continuous
batching); bad requests get 4xx answers that say what is wrong; SIGTERM stops it cleanly."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
import yaml

from evaluation.adapter import KilnLM
from evaluation.generate import Request, generate, load, sample, sample_batch
from evaluation.server import CompletionBody, Job, Scheduler, Service, create_app
from tests.conftest import free_port, kiln, server, log_tail, wait_until
from tests.test_generate import PROMPT, store  # noqa: F401  (a fixture)
from tests.test_training_kjv_data import kjv_text
from training.export import export_hf

NAME = "kiln-tiny"


@contextlib.contextmanager
def serving(service: Service, api_key: str | None = None):
    """uvicorn in a thread on a free port of 127.0.0.1; yields the base URL; stopped after, also on failure."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(service, api_key), host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: srv.started or not thread.is_alive(), 60, "the in-thread server to start")
        assert srv.started, "uvicorn stopped before it was serving"
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def export_dir(store, tmp_path_factory) -> Path:  # noqa: F811
    model = load(store / "train" / "m0")
    tokenizer = store / "tokenizer" / "t0"
    out = tmp_path_factory.mktemp("export")
    export_hf(model.cfg, model.params, (tokenizer / "tokenizer.json").read_text(),
              json.loads((tokenizer / "tokenizer_meta.json").read_text()), out)
    return out


@pytest.fixture(scope="module")
def model(export_dir):
    return load(export_dir)


@pytest.fixture(scope="module")
def served(model):
    service = Service(model, NAME, max_batch=8)
    with serving(service) as url:
        yield url, service


@pytest.fixture(scope="module")
def kiln_lm(model) -> KilnLM:
    return KilnLM(model.cfg, model.params, model.tokenizer, model.eos_id, model.bos_id, batch_size=8)


def write_task(folder: Path) -> Path:
    """A local multiple-choice task over KJV lines: a line's first words, and which of three endings
    (its own, two others') follows them. Short, so every request fits the 64-token context whole."""
    lines = [ln.split() for ln in kjv_text(20_000).splitlines() if len(ln.split()) >= 12][:30]
    rows = []
    for i in range(8):
        words = lines[i]
        endings = [" ".join(words[6:10]), " ".join(lines[i + 10][6:10]), " ".join(lines[i + 20][6:10])]
        rows.append({"context": " ".join(words[:6]), "choices": endings, "label": 0})
    data = folder / "kjv_endings.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {"task": "kjv_endings", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "context",
            "doc_to_choice": "choices", "doc_to_target": "label", "metadata": {"version": 1},
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    path = folder / "kjv_endings.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False))
    return path


def test_lm_eval_local_completions_scores_as_the_adapter_does(served, kiln_lm, export_dir, tmp_path):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from evaluation.harness import evaluate, load_task, task_manager

    url, service = served
    T = kiln_lm.cfg.seq_len
    task_file = str(write_task(tmp_path))
    (task,) = load_task(task_manager(False), task_file)
    requests = []
    for doc in task.test_docs():
        requests += task.construct_requests(doc, task.doc_to_text(doc), metadata=("kjv_endings", 0, 1))
    pairs = [kiln_lm._encode_pair(*r.args) for r in requests]
    assert len(requests) == 24 and all(len(c) + len(x) < T for c, x in pairs)  # nothing cut on either side

    expected = kiln_lm.loglikelihood(requests, disable_tqdm=True)
    # The export's tokenizer (transformers, offline), two requests of four prompts each at a time.
    api = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=NAME, tokenizer=str(export_dir),
                              tokenizer_backend="huggingface", max_length=T, batch_size=4, num_concurrent=2,
                              max_retries=1)
    got = api.loglikelihood(requests, disable_tqdm=True)
    assert len(got) == len(expected) == len(requests)
    for req, (logprob, greedy), (want, want_greedy) in zip(requests, got, expected, strict=True):
        assert logprob == pytest.approx(want, abs=1e-4), req.args
        assert greedy == want_greedy, req.args
    assert max(service.scheduler.rows_run) > 1  # concurrent requests ran together

    # Without a tokenizer named, lm-eval finds the server's own (/tokenizer_info, /tokenize).
    remote = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=NAME, max_length=T, batch_size=8,
                                 max_retries=1)
    assert remote.tokenizer_backend == "remote"
    assert [lp for lp, _ in remote.loglikelihood(requests[:8], disable_tqdm=True)] == pytest.approx(
        [lp for lp, _ in expected[:8]], abs=1e-4)

    # generate_until (greedy, stop strings, max_gen_toks) says what the adapter's greedy decoding says.
    from lm_eval.api.instance import Instance

    gen = [Instance("generate_until", {}, (r.args[0], {"until": ["\n\n"], "max_gen_toks": 12}), i)
           for i, r in enumerate(requests[::3])]
    texts = api.generate_until(gen, disable_tqdm=True)
    assert texts == kiln_lm.generate_until(gen, disable_tqdm=True) and sum(bool(t) for t in texts) > 4

    # And lm-eval's whole evaluation through the server: the accuracy those log-likelihoods give.
    acc = np.mean([np.argmax([lp for lp, _ in expected[i:i + 3]]) == 0 for i in range(0, 24, 3)])
    assert evaluate(api, [task_file], [], None)["results"]["kjv_endings"]["acc,none"] == pytest.approx(acc)


def test_lm_eval_local_chat_completions_gets_kilns_chat_answers(served, model):
    """lm-eval's chat API model (`local-chat-completions`, what `--apply_chat_template` evaluations
    of a served chat model use) sends its messages, stop strings and seed to /v1/chat/completions
    and gets the answers `kiln generate --chat` gives, cut at the task's stop string."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion

    url, _ = served
    api = LocalChatCompletion(base_url=f"{url}/v1/chat/completions", model=NAME, max_retries=1, num_concurrent=2)
    questions = ["Who made the light?", "What did God divide?", "Where was the garden?", "Who said it was good?"]
    stop = ",."  # the tiny model answers in punctuation
    requests = [Instance("generate_until", {}, (JsonChatStr(json.dumps([{"role": "user", "content": q}])),
                                                {"until": [stop], "max_gen_toks": 12, "do_sample": False}), i)
                for i, q in enumerate(questions)]
    answers = [generate(model, q, max_tokens=12, temperature=0.0, chat=True) for q in questions]
    assert sum(stop in a for a in answers) >= 1  # the stop string cuts at least one of them
    assert api.generate_until(requests, disable_tqdm=True) == [a.split(stop)[0] for a in answers]


def test_openai_client_completions_and_chat(served, model):
    from openai import BadRequestError, NotFoundError, OpenAI

    url, _ = served
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    done = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0)
    assert done.object == "text_completion" and done.choices[0].finish_reason in ("stop", "length")
    assert done.choices[0].text == generate(model, PROMPT, max_tokens=16, temperature=0.0)
    assert done.usage.prompt_tokens == 1 + len(model.tokenizer.encode(PROMPT).ids)  # the start token, then the text

    seeded = [client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9,
                                        seed=s).choices[0].text for s in (7, 7, 8, 9, 10)]
    assert seeded[0] == seeded[1] and len(set(seeded)) > 2

    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Who made the light?"}],
                                          max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    choice = chat.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == generate(model, "Who made the light?", max_tokens=16, temperature=0.0, chat=True)
    assert len(choice.logprobs.content) == chat.usage.completion_tokens - (choice.finish_reason == "stop")
    for entry in choice.logprobs.content:  # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0

    with pytest.raises(NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(BadRequestError, match="context is 64 tokens"):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=64)


def test_n_choices_per_prompt_each_with_a_seed_of_its_own(served, model):
    """`n` (RL rollouts ask several answers per prompt): choice j of prompt p is index p*n + j, the
    first is the n=1 answer of the same seed, the others differ and repeat with the seed;
    prompt tokens count once per prompt; chat and streaming take n too."""
    from openai import OpenAI

    url, service = served
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    ask = dict(model=NAME, max_tokens=12, temperature=1.0, seed=11)
    one = client.completions.create(**ask, prompt=PROMPT)
    before = len(service.scheduler.admitted)
    four = client.completions.create(**ask, prompt=PROMPT, n=4)
    # the four rows share their prompt's prefill (admitted together: one prompt for four rows)
    assert list(service.scheduler.admitted)[before:] == [(1, 4)], list(service.scheduler.admitted)[before:]
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    texts = [c.text for c in four.choices]
    assert texts[0] == one.choices[0].text and len(set(texts)) > 2
    assert texts == [c.text for c in client.completions.create(**ask, prompt=PROMPT, n=4).choices]
    assert four.usage.prompt_tokens == one.usage.prompt_tokens
    counted = client.completions.create(**ask, prompt=PROMPT, n=4, logprobs=0)  # its tokens, one by one
    assert [c.text for c in counted.choices] == texts
    assert four.usage.completion_tokens == sum(len(c.logprobs.tokens) + (c.finish_reason == "stop")
                                               for c in counted.choices)

    before = len(service.scheduler.admitted)
    both = client.completions.create(**ask, prompt=[PROMPT, "And God"], n=2).choices
    assert sum(p for p, _ in list(service.scheduler.admitted)[before:]) >= 2  # two prompts: each prefilled
    assert [c.index for c in both] == [0, 1, 2, 3] and [c.text for c in both[:2]] == texts[:2]
    assert both[2].text == client.completions.create(**ask, prompt="And God").choices[0].text

    streamed = ["", "", ""]
    for chunk in client.completions.create(**ask, prompt=PROMPT, n=3, stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == texts[:3]

    chat = dict(model=NAME, messages=[{"role": "user", "content": "Who made the light?"}], max_tokens=10,
                temperature=1.0, seed=2)
    answers = client.chat.completions.create(**chat, n=3).choices
    assert [a.index for a in answers] == [0, 1, 2]
    assert answers[0].message.content == client.chat.completions.create(**chat).choices[0].message.content
    assert len({a.message.content for a in answers}) > 1


def test_logit_bias_and_penalties_reach_the_draws(served, model):
    """OpenAI's logit_bias, presence_penalty and frequency_penalty (and vLLM's repetition_penalty)
    over HTTP: a bias of 100 on a
    token makes greedy decoding answer it throughout, in completions and chat; a penalty changes
    the greedy answer as `sample_batch` with the same settings does (tests/test_generate.py checks
    that against a plain loop)."""
    from openai import OpenAI

    url, _ = served
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    word = model.tokenizer.encode(" Amen").ids[0]
    ask = dict(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    forced = client.completions.create(**ask, logit_bias={str(word): 100}).choices[0].text
    assert forced == model.tokenizer.decode([word] * 6)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Who?"}], max_tokens=3,
                                          temperature=0, logit_bias={str(word): 100})
    assert chat.choices[0].message.content == model.tokenizer.decode([word] * 3)

    ids = [model.start_id, *model.tokenizer.encode(PROMPT).ids]
    for penalties in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1.5}):
        want = sample_batch(model, [Request(ids, 24, 0.0, presence_penalty=penalties.get("presence_penalty", 0.0),
                                            frequency_penalty=penalties.get("frequency_penalty", 0.0),
                                            repetition_penalty=penalties.get("repetition_penalty", 1.0))])[0].ids
        extra = {"extra_body": penalties} if "repetition_penalty" in penalties else penalties  # vLLM's, not OpenAI's
        got = client.completions.create(**{**ask, "max_tokens": 24}, **extra).choices[0].text
        assert got == model.tokenizer.decode(want) != client.completions.create(**{**ask, "max_tokens": 24}).choices[0].text


def test_vllm_sampling_extras_reach_the_draws(served, model):
    """vLLM's top_k, min_p, min_tokens, stop_token_ids, ignore_eos and return_tokens_as_token_ids
    over HTTP: top_k 1 and min_p 1 sample greedily; a stop token id ends the answer before it;
    with EOS forced by a logit bias the answer is empty, min_tokens 3 holds EOS back for three
    tokens, and ignore_eos lets it run to max_tokens; logprobs can name tokens by their ids."""
    from openai import OpenAI

    url, _ = served
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    ask = dict(model=NAME, prompt=PROMPT, max_tokens=12)
    greedy = client.completions.create(**ask, temperature=0, logprobs=0).choices[0]
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = client.completions.create(**ask, temperature=1.0, seed=9, extra_body=extra)
        assert sampled.choices[0].text == greedy.text
    assert client.completions.create(**ask, temperature=1.0, seed=9, extra_body={"top_k": -1}).choices[0].text != \
        greedy.text  # -1 (vLLM's "all") samples

    tokens = sample(model, [model.start_id, *model.tokenizer.encode(PROMPT).ids], 12, temperature=0.0)
    j = next(j for j in range(1, len(tokens)) if tokens[j] not in tokens[:j])  # new at j: the answer ends before it
    cut = client.completions.create(**ask, temperature=0, extra_body={"stop_token_ids": [tokens[j]]}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == model.tokenizer.decode(tokens[:j]) != greedy.text

    eos = {str(model.eos_id): 100}
    ended = client.completions.create(**ask, temperature=0, logit_bias=eos)
    assert ended.choices[0].text == "" and ended.choices[0].finish_reason == "stop"
    assert ended.usage.completion_tokens == 1
    held = client.completions.create(**ask, temperature=0, logit_bias=eos, extra_body={"min_tokens": 3})
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 4 and held.choices[0].text
    ignored = client.completions.create(**ask, temperature=0, logit_bias=eos, extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Who?"}], max_tokens=5,
                                          temperature=0, logit_bias=eos, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5

    # return_tokens_as_token_ids: logprobs name each token by its id, the same tokens and values
    named = client.completions.create(**ask, temperature=0, logprobs=2, echo=True,
                                      extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    prompt_ids = [model.start_id, *model.tokenizer.encode(PROMPT).ids]
    assert named.tokens == [f"token_id:{t}" for t in [*prompt_ids, *tokens]]
    assert named.token_logprobs[len(prompt_ids):] == pytest.approx(greedy.logprobs.token_logprobs, abs=1e-5)
    assert all(key.startswith("token_id:") for top in named.top_logprobs[1:] for key in top)
    chat = dict(model=NAME, messages=[{"role": "user", "content": "Who?"}], max_tokens=5, temperature=0,
                logprobs=True, top_logprobs=2)
    by_text = client.chat.completions.create(**chat).choices[0].logprobs.content
    by_id = client.chat.completions.create(**chat, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert [e.logprob for e in by_id.logprobs.content] == [e.logprob for e in by_text]
    assert all(e.token.startswith("token_id:") and e.bytes == list(e.token.encode()) for e in by_id.logprobs.content)
    assert [model.tokenizer.decode([int(e.token.removeprefix("token_id:"))], skip_special_tokens=True)
            for e in by_id.logprobs.content] == [e.token for e in by_text]

    # chat's add_generation_prompt and continue_final_message: the prompt's token ids as the
    # template gives them, answered as /v1/completions answers those ids
    from training.chat_template import ChatTemplate

    template, end = ChatTemplate(model.tokenizer), model.tokenizer.token_to_id("<|end|>")
    talk = [{"role": "user", "content": "Who made the light?"}, {"role": "assistant", "content": "And God"}]
    prefill = {"continue_final_message": True, "add_generation_prompt": False}
    for extra, ids in ((prefill, template.encode(talk)[0][:-1]), ({"add_generation_prompt": False},
                                                                   template.encode(talk[:1])[0])):
        answer = client.chat.completions.create(model=NAME, messages=talk if "continue_final_message" in extra else
                                                talk[:1], max_tokens=8, temperature=0, extra_body=extra)
        same = client.completions.create(model=NAME, prompt=[model.start_id, *ids], max_tokens=8, temperature=0,
                                          extra_body={"stop_token_ids": [end]})
        assert answer.choices[0].message.content == same.choices[0].text != "", extra


def test_an_api_key_guards_the_v1_endpoints(model):
    """With an API key, /v1 requests need `Authorization: Bearer <key>` (the openai client's
    api_key): without it or with another a 401 in OpenAI's error format, counted in the
    metrics; with it the answer; /health and /metrics stay open."""
    import openai

    with serving(Service(model, NAME, max_batch=2), api_key="s3cret") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, temperature=0).choices[0].text
        with pytest.raises(openai.AuthenticationError, match="not this server's"):
            openai.OpenAI(base_url=f"{url}/v1", api_key="guess", max_retries=0).models.list()
        bare = httpx.get(f"{url}/v1/models", timeout=30)
        assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
        assert "no Authorization header" in bare.json()["error"]["message"]
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        scraped = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'endpoint="/v1/models",model_name="kiln-tiny",status="401"} 2.0' in scraped


def test_metrics_count_what_the_server_answered(served):
    """GET /metrics (Prometheus' text format): between two scrapes, the requests by endpoint and
    status, the prompt and generation tokens the answers' usage reported, one latency per answer,
    a time to first token per streamed answer, the batches the engine ran, and the prompt tokens
    admitted and found in the prefix cache (a prompt of 40 token ids, sent twice: its first block
    of 32 is found the second time, whose streamed usage says so)."""
    from prometheus_client.parser import text_string_to_metric_families

    url, _ = served

    def scrape() -> dict:
        response = httpx.get(f"{url}/metrics", timeout=30)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
                for family in text_string_to_metric_families(response.text) for s in family.samples}

    before = scrape()
    ask = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    plain = httpx.post(f"{url}/v1/completions", json=ask, timeout=60).json()

    def streamed_usage(ask: dict) -> dict:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={**ask, "stream": True, "stream_options": {"include_usage": True}}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        return events[-1]["usage"]

    streamed = streamed_usage(ask)
    ids = [int(i) for i in np.random.default_rng(356).integers(10, 200, 40)]  # a prompt no other test sends
    twice = [httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 1}, timeout=60).json()["usage"],
             streamed_usage({"prompt": ids, "max_tokens": 1})]
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "top_p": 0}, timeout=60).status_code == 400
    assert httpx.get(f"{url}/nothing/here", timeout=60).status_code == 404
    after = scrape()

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("kiln_requests_total", endpoint="/v1/completions", status="200") == 4
    assert delta("kiln_requests_total", endpoint="/v1/completions", status="400") == 1
    assert delta("kiln_requests_total", endpoint="other", status="404") == 1
    prompts = plain["usage"]["prompt_tokens"] + streamed["prompt_tokens"]
    assert delta("kiln_prompt_tokens_total") == prompts + 2 * len(ids)
    assert delta("kiln_prefix_cache_queries_total") == prompts + 2 * len(ids) and prompts < 32
    assert delta("kiln_prefix_cache_hits_total") == 32
    # each answer's usage says what it found: the second 40-token prompt its first block
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in (plain["usage"], streamed, *twice)]
    assert cached == [0, 0, 0, 32]
    assert delta("kiln_generation_tokens_total") == (plain["usage"]["completion_tokens"] + streamed["completion_tokens"]
                                                     + sum(u["completion_tokens"] for u in twice))
    assert delta("kiln_e2e_request_latency_seconds_count", endpoint="/v1/completions") == 4
    assert delta("kiln_time_to_first_token_seconds_count") == 2
    assert delta("kiln_batch_jobs_count") >= 2 and delta("kiln_batch_seconds_sum") > 0
    assert after[("kiln_num_requests_waiting", ())] == after[("kiln_num_requests_running", ())] == 0


def test_streamed_answers_add_up_to_the_answers_without_streaming(served, model):
    """stream=true: OpenAI's server-sent events, whose pieces add up to the text the same request
    gets without streaming (same seed), stop strings included (a piece never runs past one),
    several prompts each under its own index, chat with its role first and usage last."""
    from openai import OpenAI

    url, _ = served
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    ask = dict(model=NAME, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=3)
    whole = client.completions.create(**ask).choices[0]
    chunks = list(client.completions.create(**ask, stream=True))
    assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks) == whole.text
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + [whole.finish_reason]

    stop = whole.text[len(whole.text) // 3:][:3]  # from inside the answer: it ends before it
    cut = client.completions.create(**ask, stop=[stop, "\n\n\n"]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and len(cut.text) < len(whole.text)
    pieces = [c.choices[0].text for c in client.completions.create(**ask, stop=[stop, "\n\n\n"], stream=True)]
    assert "".join(pieces) == cut.text

    prompts = [PROMPT, "And God", "In the"]
    unstreamed = client.completions.create(**{**ask, "prompt": prompts}).choices
    texts = ["", "", ""]
    for c in client.completions.create(**{**ask, "prompt": prompts}, stream=True):
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [c.text for c in sorted(unstreamed, key=lambda c: c.index)]

    chat = dict(model=NAME, messages=[{"role": "user", "content": "Who made the light?"}], max_tokens=24,
                temperature=0.8, seed=5)
    answer = client.chat.completions.create(**chat)
    events = list(client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    assert events[0].object == "chat.completion.chunk" and events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == answer.choices[0].message.content
    assert events[-1].choices == [] and events[-1].usage == answer.usage
    assert events[-2].choices[0].finish_reason == answer.choices[0].finish_reason

    # on the wire: `data: {json}` events, then `data: [DONE]`
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True},
                      timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: {") for line in lines[:-1])

    # a client that leaves mid-stream costs the others nothing
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "stream": True},
                      timeout=60) as response:
        next(response.iter_lines())
    assert client.completions.create(**ask).choices[0].text == whole.text


def test_streamed_logprobs_and_echo_add_up_to_the_answers_without_streaming(served):
    """stream=true with logprobs (and echo): each chunk carries the log-probabilities of the tokens
    whose text it completes, and the chunks' lists joined are the request's own without
    streaming (same seed): tokens, log-probabilities, alternatives, text offsets, also with a
    stop string, several choices, an echoed prompt scored first, and chat's `logprobs.content`.
    A prompt is scored once however many choices it has: without streaming by its first
    choice's job (one job per choice, as lm-eval's loglikelihood requests need), streamed by a
    job of its own before the choices'."""
    url, service = served

    def streamed(path: str, body: dict) -> list[dict]:
        with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as response:
            assert response.status_code == 200, response.read()
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    def joined(chunks: list[dict], n: int) -> list[dict]:  # each choice's text and logprobs, chunks joined
        out = [{"text": "", "logprobs": {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []},
                "finish_reason": None} for _ in range(n)]
        for c in chunks:
            choice = c["choices"][0]
            assert "error" not in c and len(c["choices"]) == 1
            got = out[choice["index"]]
            got["text"] += choice["text"]
            for key, values in (choice["logprobs"] or {}).items():
                got["logprobs"][key] += values
            got["finish_reason"] = choice["finish_reason"]
        return out

    ask = dict(prompt=PROMPT, max_tokens=30, temperature=1.0, seed=7, logprobs=3)
    whole = httpx.post(f"{url}/v1/completions", json=ask, timeout=120).json()["choices"]
    chunks = streamed("/v1/completions", ask)
    assert len(chunks) > 3 and any(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks[:-1])
    assert joined(chunks, 1) == [{k: v for k, v in c.items() if k != "index"} for c in whole]

    stop = whole[0]["text"][len(whole[0]["text"]) // 2:][:2]  # from inside the answer: it ends before it
    before = httpx.post(f"{url}/v1/completions", json={**ask, "stop": [stop]}, timeout=120).json()["choices"][0]
    through = httpx.post(f"{url}/v1/completions", json={**ask, "stop": [stop], "include_stop_str_in_output": True},
                         timeout=120).json()["choices"][0]
    assert through["text"] == before["text"] + stop and through["finish_reason"] == before["finish_reason"] == "stop"
    assert len(through["logprobs"]["tokens"]) > len(before["logprobs"]["tokens"])  # the stop's tokens kept too
    for body in ({**ask, "stop": [stop]}, {**ask, "stop": [stop], "include_stop_str_in_output": True},
                 {**ask, "n": 2, "echo": True, "max_tokens": 12},
                 {**ask, "echo": True, "max_tokens": 0}, {**ask, "echo": True, "logprobs": None}):
        jobs = service.scheduler.taken
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"]
        assert service.scheduler.taken - jobs == len(whole)
        got = joined(streamed("/v1/completions", body), len(whole))
        assert service.scheduler.taken - jobs == 2 * len(whole) + ("echo" in body and bool(body["logprobs"]))
        for choice in whole:
            choice.pop("index")
            if body["logprobs"] is None:
                choice["logprobs"] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        assert got == whole, body
    assert whole[0]["text"].startswith(PROMPT)

    chat = dict(messages=[{"role": "user", "content": "Who made the light?"}], max_tokens=16, temperature=0.8, seed=5,
                logprobs=True, top_logprobs=2)
    answer = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]
    events = streamed("/v1/chat/completions", chat)
    content = [e for c in events if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert content == answer["logprobs"]["content"] and len(content) > 1
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in events) == answer["message"]["content"]


def test_greedy_echo_and_batches_agree_with_kiln(served, model, kiln_lm):
    url, service = served
    prompt = [model.start_id, *model.tokenizer.encode(PROMPT).ids]
    greedy = sample(model, prompt, 16, temperature=0.0)
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                       "logprobs": 0}, timeout=60).json()["choices"][0]
    assert answer["text"] == model.tokenizer.decode(greedy, skip_special_tokens=False)
    assert answer["logprobs"]["tokens"] == [model.tokenizer.decode([t], skip_special_tokens=False) for t in greedy]

    # echo with logprobs: each prompt token's log-probability, as the adapter scores it
    ids = model.tokenizer.encode(kjv_text(2_000).splitlines()[3]).ids[:15]
    echoed = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 3},
                        timeout=60).json()["choices"][0]
    logprobs = echoed["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert echoed["text"] == model.tokenizer.decode(ids, skip_special_tokens=False)
    for cut in (1, 7, 14):
        (want, _), = kiln_lm.score_continuations([(ids[:cut], ids[cut:])])
        assert sum(logprobs["token_logprobs"][cut:]) == pytest.approx(want, abs=1e-4)
    for lp, top in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
        assert 3 <= len(top) <= 4 and lp in top.values() and max(top.values()) >= lp

    # A prompt's tokens and log-probabilities are the same alone and decoding beside others
    # (prompts and lengths within one bucket, 16, so that this compiles little).
    rows = [Job(Request(prompt, 12, 0.0), top_logprobs=0),
            Job(Request(prompt[:3], 16, 1.0, 0.8, seed=5), top_logprobs=0),
            Job(Request(ids[:14], 9, 0.7, 1.0, seed=2, stop_ids=(model.eos_id,)), top_logprobs=0),
            Job(Request(ids, 0), score_prompt=True, top_logprobs=0),
            Job(Request(prompt * 2, 5, 1.0, seed=11), score_prompt=True, top_logprobs=0)]
    scheduler = service.scheduler  # the served one: what it compiled, this reuses
    before = len(scheduler.rows_run)
    together = results(scheduler, rows)
    assert max(list(scheduler.rows_run)[before:]) > 1
    assert together[1].sampled.ids != sample(model, prompt[:3], 16, 1.0, 0.8, seed=6)  # the seed matters
    for job, batched in zip(rows, together):
        (alone,) = results(scheduler, [job])
        assert batched.sampled.ids == alone.sampled.ids
        assert len(alone.sampled.logprobs) == len(alone.sampled.ids)
        assert np.allclose(batched.sampled.logprobs, alone.sampled.logprobs, atol=1e-5)
        if job.score_prompt:
            assert np.allclose(batched.prompt_logprobs[1:], alone.prompt_logprobs[1:], atol=1e-5)
        if job.row.max_tokens:  # and as sample_batch draws them, in one batch of its own
            (drawn,) = sample_batch(model, [job.row], top_logprobs=0)
            assert drawn.ids == alone.sampled.ids and np.allclose(drawn.logprobs, alone.sampled.logprobs, atol=1e-5)
    assert together[0].sampled.ids == sample(model, prompt, 12, 0.0)

    # The same through HTTP: concurrent requests are batched and answered as they are one by one.
    bodies = [{"prompt": PROMPT, "max_tokens": 10 + i, "temperature": 0.9, "seed": i} for i in range(6)]
    one_by_one = [httpx.post(f"{url}/v1/completions", json=b, timeout=60).json()["choices"][0]["text"] for b in bodies]
    before, window = len(scheduler.rows_run), scheduler.window_s
    scheduler.window_s = 1.0  # so that all six start together, however loaded the machine
    try:
        with httpx.Client(timeout=60) as client, concurrent.futures.ThreadPoolExecutor(6) as pool:
            at_once = list(pool.map(lambda b: client.post(f"{url}/v1/completions", json=b), bodies))
    finally:
        scheduler.window_s = window
    assert [r.json()["choices"][0]["text"] for r in at_once] == one_by_one
    assert max(list(scheduler.rows_run)[before:]) > 1, list(scheduler.rows_run)[before:]


def results(scheduler: Scheduler, jobs: list[Job]) -> list:
    """The jobs' results, submitted at once (so that they start together, when the scheduler is idle)."""
    return [f.result(120) for f in [scheduler.submit(j) for j in jobs]]


def test_a_short_request_is_answered_while_a_long_one_decodes(model):
    """Continuous batching: a request that comes while a long answer decodes takes a free slot at
    the next chunk and is answered long before the long one ends, with the tokens it gets alone;
    more prompts than slots wait for one. A stream whose consumer fails, a row the model cannot
    run (a logit bias outside the vocabulary: refused when taken) and one whose admission fails
    (a seed that is no integer: every row in the slots runs again alone) fail their own jobs
    only, as the server's validation would have refused the last two; a cancelled job stops
    decoding."""
    after_chunk: list = []  # what to do after the next chunk of decoding steps
    scheduler = Scheduler(model, max_batch=2, steps=4, on_chunk=lambda *_: after_chunk and after_chunk.pop()())
    try:
        long = Request([model.start_id, 11], 40, 0.0, stop_ids=())
        short = [Job(Request([model.start_id, 12 + i, 13], 3, 1.0, seed=i, stop_ids=(model.eos_id,)))
                 for i in range(3)]
        alone = [results(scheduler, [job])[0].sampled.ids for job in (Job(long), *short)]
        ended: list[str] = []
        quick: list = []

        def arrive():  # three short requests come after the long answer's first chunk (its 5th token)
            for n, job in enumerate(short):
                quick.append(scheduler.submit(job))
                quick[-1].add_done_callback(lambda _, n=n: ended.append(f"short {n}"))

        after_chunk.append(arrive)
        waiting = scheduler.submit(Job(long))
        waiting.add_done_callback(lambda _: ended.append("long"))
        assert waiting.result(60).sampled.ids == alone[0]
        assert ended == ["short 0", "short 1", "short 2", "long"]  # three for one free slot: in turn, all first
        assert [f.result().sampled.ids for f in quick] == alone[1:]
        assert max(scheduler.rows_run) == 2

        def broken(i, t, lp, top):
            raise RuntimeError("the client went away")

        fails = [Job(Request([model.start_id, 11], 6, 0.0, stop_ids=(), stream=broken)),
                 Job(Request([model.start_id, 11], 6, 0.0, logit_bias=((model.cfg.vocab_size + 3, 1.0),))),
                 Job(Request([model.start_id, 11], 6, 0.5, seed=1.5))]  # no integer: its admission fails
        futures = [scheduler.submit(j) for j in [short[1], fails[0], fails[1], fails[2], short[2]]]
        assert "went away" in str(futures[1].exception(60))
        assert "outside the model's vocabulary" in str(futures[2].exception(60))  # refused when taken
        assert isinstance(futures[3].exception(60), TypeError)  # the slots ran again alone: only it failed
        too_long = scheduler.submit(Job(Request(list(range(1, model.cfg.seq_len + 2)), 4), score_prompt=True))
        assert "do not fit" in str(too_long.exception(60))  # refused when taken, not scored as well
        assert [futures[i].result(60).sampled.ids for i in (0, 4)] == [
            results(scheduler, [j])[0].sampled.ids for j in (short[1], short[2])]

        # A job cancelled while it decodes (a client that went away) gets no more tokens, and its
        # slot goes to the next prompt: nothing is answered to it, and the others are unchanged.
        sent: list[int] = []
        gone: list = []

        def leaves(i, token, lp, top):
            sent.append(token)
            if i == 2:
                gone[0].cancel()

        gone.append(scheduler.submit(Job(Request(long.prompt, long.max_tokens, 0.0, stop_ids=(), stream=leaves))))
        after = scheduler.submit(short[0])
        assert after.result(60).sampled.ids == alone[1]
        assert gone[0].cancelled() and sent == alone[0][:3]
        wait_until(lambda: scheduler.running_count() == 0, 60, "the slots to empty")
    finally:
        scheduler.close()


def test_a_streamed_answer_gets_its_text_every_stream_interval(model):
    """While an answer streams, a chunk has as many decoding steps as take `stream_interval_s` at
    the last chunk's pace (one at least), so that its text goes out that often: with 0, token by
    token (as vLLM streams); with an hour, in whole chunks, as unstreamed. Either way its tokens
    are those the same request gets unstreamed."""

    def calls_of_each_token(interval_s: float) -> list[int]:  # the calls on the model before each token came
        scheduler = Scheduler(model, max_batch=2, steps=4, stream_interval_s=interval_s)
        try:
            request = Request([model.start_id, 11], 10, 0.0, stop_ids=())
            before = len(scheduler.rows_run)
            (plain,) = results(scheduler, [Job(request)])
            assert len(scheduler.rows_run) - before == 4  # admission (the first token), then chunks of 4, 4 and 1
            calls: list[int] = []
            streamed = scheduler.submit(Job(dataclasses.replace(
                request, stream=lambda *_: calls.append(len(scheduler.rows_run)))))
            assert streamed.result(60).sampled.ids == plain.sampled.ids
            return [c - calls[0] for c in calls]
        finally:
            scheduler.close()

    assert calls_of_each_token(0.0) == list(range(10))  # each token after a call of its own
    assert calls_of_each_token(3600.0) == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]  # chunks of 4


def test_a_streaming_client_that_goes_away_frees_its_slot(served, model):
    """A client that closes its stream: the server notices at its next event, cancels the job, and
    the job's slot decodes no more (a job beside it slows each chunk, so the closed one would
    otherwise still be decoding)."""
    url, service = served
    scheduler = service.scheduler
    slow = scheduler.submit(Job(Request([model.start_id, 11], 60, 0.0, stop_ids=(),
                                        stream=lambda *_: time.sleep(0.05))))
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as answer:
        assert next(answer.iter_lines()).startswith("data: ")
        (row,) = [r for r in list(scheduler.live) if r is not None and r.job.row.max_tokens == 40]
    wait_until(lambda: row.future.cancelled(), 30, "the server to cancel the job of a client that went away")
    wait_until(lambda: row not in scheduler.live, 30, "its slot to be freed")
    assert len(row.ids) < 40 and not slow.done()
    assert len(slow.result(60).sampled.ids) == 60


def test_a_client_that_gives_up_waiting_frees_its_slot(served, model):
    """A client that times out before its (non-streamed) answer: the server notices the closed
    connection while it waits, cancels the request's job, the job decodes no more (as above, a
    slowed job beside it keeps the chunks long), and the request counts as a 499."""
    url, service = served
    scheduler = service.scheduler
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    long = Request([model.start_id, 11], 60, 0.0, stop_ids=())
    warm = scheduler.submit(Job(long))  # the same shapes once, so that nothing below waits for a compile
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    warm.result(60)

    def gave_up() -> float:
        return service.metrics.registry.get_sample_value(
            "kiln_requests_total", {"model_name": NAME, "endpoint": "/v1/completions", "status": "499"}) or 0.0

    before = gave_up()
    slow = scheduler.submit(Job(Request(long.prompt, 60, 0.0, stop_ids=(), stream=lambda *_: time.sleep(0.1))))
    timed_out: list = []

    def give_up() -> None:
        try:
            httpx.post(f"{url}/v1/completions", json=body, timeout=1.5)
        except httpx.ReadTimeout as e:
            timed_out.append(e)

    client = threading.Thread(target=give_up)
    client.start()
    row = wait_until(lambda: next((r for r in list(scheduler.live) if r is not None and r.job.row.max_tokens == 40),
                                  None), 30, "the request to decode")
    client.join(30)
    assert timed_out
    wait_until(lambda: row.future.cancelled(), 30, "the server to cancel the job of a client that gave up")
    wait_until(lambda: row not in scheduler.live, 30, "its slot to be freed")
    assert len(row.ids) < 40 and not slow.done()
    assert len(slow.result(60).sampled.ids) == 60
    wait_until(lambda: gave_up() == before + 1, 30, "the request to count as a 499")


def test_structured_outputs_hold_each_answer_to_its_format(served, model, caplog):
    """OpenAI's response_format and vLLM's structured_outputs: drawn at temperature 1, every
    answer follows its JSON schema, regex or choices (the same requests without a format give
    text that does not), and ends with "stop" once complete; a stream's pieces add up to the
    answer without streaming; a free answer decoding beside a formatted one draws its tokens
    as alone; in a batch that fails, a formatted answer runs again alone and is the same."""
    import re

    from openai import OpenAI

    url, service = served
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 8},
                             "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
    chat = dict(model=NAME, messages=[{"role": "user", "content": "Who made the light?"}], max_tokens=40,
                temperature=1.0, seed=4, n=4)
    answers = client.chat.completions.create(
        **chat, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    for choice in answers.choices:
        person = json.loads(choice.message.content)
        assert set(person) == {"name", "age"} and isinstance(person["name"], str) and len(person["name"]) <= 8
        assert isinstance(person["age"], int) and 0 <= person["age"] <= 150 and choice.finish_reason == "stop"
    assert len({c.message.content for c in answers.choices}) > 1  # drawn, not forced: the choices differ
    for free in client.chat.completions.create(**chat).choices:
        with pytest.raises(json.JSONDecodeError):
            json.loads(free.message.content)

    ask = dict(model=NAME, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=7, n=6)
    regex = client.completions.create(**ask, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", c.text) and c.finish_reason == "stop" for c in regex.choices)
    options = ["the LORD", "Moses", "no one"]
    chosen = client.completions.create(**ask, extra_body={"structured_outputs": {"choice": options}})
    assert all(c.text in options for c in chosen.choices) and len({c.text for c in chosen.choices}) > 1
    assert not any(c.text in options for c in client.completions.create(**ask).choices)
    lark = 'start: "In the " word "." \nword: /[a-z]{2,6}/'  # llguidance's Lark: a sentence of one word
    said = client.completions.create(**ask, extra_body={"structured_outputs": {"grammar": lark}})
    assert all(re.fullmatch("In the [a-z]{2,6}[.]", c.text) and c.finish_reason == "stop" for c in said.choices)

    # any JSON object (unbounded: greedy, it may not end within max_tokens), and a stream of one
    anything = client.completions.create(**dict(ask, n=1, max_tokens=40, temperature=0),
                                         extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert anything.finish_reason == "length" or isinstance(json.loads(anything.text), dict)
    assert anything.text.startswith("{")
    one = dict(ask, n=1, max_tokens=40, extra_body={"structured_outputs": {"json": schema}})
    whole = client.completions.create(**one).choices[0].text
    assert set(json.loads(whole)) == {"name", "age"}
    assert "".join(c.choices[0].text for c in client.completions.create(**one, stream=True)) == whole

    # beside a formatted answer (one token a chunk while it decodes), a free one draws as alone
    free = dict(model=NAME, prompt="In the beginning", max_tokens=30, temperature=0)
    alone = client.completions.create(**free).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        formatted = pool.submit(client.completions.create, **dict(one, max_tokens=30))
        beside = pool.submit(client.completions.create, **free)
        assert beside.result().choices[0].text == alone
        json.loads(formatted.result().choices[0].text)

    # a batch that fails (a seed that is no integer): the formatted answer runs again alone
    grammar = service.grammar(CompletionBody(prompt="x", structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"}),
                              model.stop_ids)
    ids = [model.start_id, *model.tokenizer.encode(PROMPT).ids]
    scheduler = Scheduler(model, max_batch=4, window_s=5)
    try:
        fine = Job(Request(ids, 12, 1.0, seed=3, stop_ids=model.stop_ids), grammar=grammar)
        bad = Job(Request(ids, 12, 1.0, seed="x", stop_ids=model.stop_ids), grammar=grammar)
        futures = [scheduler.submit(job) for job in (fine, bad)]
        with pytest.raises(Exception):
            futures[1].result(120)
        again = futures[0].result(120).sampled.ids
        assert "decoding the slots failed" in caplog.text  # the two were admitted together, and that failed
        assert again == scheduler.submit(fine).result(120).sampled.ids
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", model.tokenizer.decode(again))
    finally:
        scheduler.close()


HI = [{"role": "user", "content": "hi"}]
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
BAD = [  # (method, path, body (None: send `raw`), raw bytes, status, words the message must contain)
    ("POST", "/v1/completions", None, b'{"prompt": "x", ', 400, "not valid JSON"),
    ("POST", "/v1/completions", None, b'["a list"]', 400, "must be a JSON object (got ['a list'])"),
    ("POST", "/v1/completions", {"max_tokens": 4}, None, 400, "prompt: required"),
    ("POST", "/v1/completions", {"prompt": 12}, None, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": []}, None, 400, "none of them empty"),
    ("POST", "/v1/completions", {"prompt": [[1, 2], []]}, None, 400, "none of them empty"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}, None, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, None, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x " * 70, "max_tokens": 4}, None, 400, "context is 64 tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 64}, None, 400, "lower max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "model": "llama-70b"}, None, 404, "not served here"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 0}, None, 400, "n: Input should be greater than or equal to 1"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 1000}, None, 400, "n: Input should be less than or equal to 128"),
    ("POST", "/v1/completions", {"prompt": "x", "best_of": 2}, None, 400, "only best_of=1"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, None, 400, "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 1.5}, None, 400, "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}, None, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 50}, None, 400, "logprobs"),
    ("POST", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, None, 400,
     "stream_options needs stream=true"),
    ("POST", "/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, None, 400, "frequency_penalty"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, None, 400,
     "min_tokens=5 is more than max_tokens=4"),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": -2}, None, 400, "top_k"),
    ("POST", "/v1/completions", {"prompt": "x", "min_p": 1.5}, None, 400, "min_p"),
    ("POST", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, None, 400, "repetition_penalty"),
    ("POST", "/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, None, 400, "outside this model's vocab"),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, None, 400, "strings of digits"),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, None, 400, "outside this model's vocab"),
    ("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, None, 400, "logit_bias.5"),
    ("POST", "/v1/completions", {"prompt": "x", "suffix": "y"}, None, 400, "suffix"),
    ("POST", "/v1/completions", {"prompt": "x", "beam_width": 4}, None, 400, "beam_width: not a field"),
    ("POST", "/v1/completions", {"prompt": [1, 2, 99999]}, None, 400, "outside this model's vocabulary"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": "abc"}, None, 400, "seed"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": 3}, None, 400, "stop"),
    ("POST", "/v1/chat/completions", {"messages": []}, None, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
                                      "add_generation_prompt": False}, None, 400, "must be the assistant's"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, None, 400, "role"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 80}]}, None, 400,
     "context of 64"),
    ("POST", "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "[a-"}}, None, 400,
     "structured_outputs: at 1(8): invalid regex"),
    ("POST", "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, None, 400,
     "exactly one of json, regex, choice or grammar (got choice, regex)"),
    ("POST", "/v1/completions", {"prompt": "x", "structured_outputs": {"json": {"type": "wat"}}}, None, 400,
     "structured_outputs: Invalid type: wat"),
    ("POST", "/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}}, None, 400,
     "response_format: type json_schema needs json_schema.schema"),
    ("POST", "/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, None, 400, "response_format.type"),
    ("POST", "/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"},
                                 "structured_outputs": {"regex": "a"}}, None, 400, "not both"),
    # function calling (tests/test_tool_calls.py has a model whose template writes calls)
    ("POST", "/v1/chat/completions", {"messages": HI, "tools": [ADD]}, None, 400,
     'tool_choice "auto" reads the calls the model writes in its chat template\'s format'),
    ("POST", "/v1/chat/completions", {"messages": HI, "tool_choice": "required"}, None, 400,
     "tool_choice 'required' needs tools to choose from"),
    ("POST", "/v1/chat/completions", {"messages": HI, "tools": [ADD], "tool_choice": {
        "type": "function", "function": {"name": "sub"}}}, None, 400, "names the function 'sub', which is not among"),
    ("POST", "/v1/chat/completions", {"messages": HI, "tools": [ADD, ADD], "tool_choice": "required"}, None, 400,
     "tools name a function twice: ['add']"),
    ("POST", "/v1/chat/completions", {"messages": HI, "tools": [ADD], "tool_choice": "required",
                                      "response_format": {"type": "json_object"}}, None, 400,
     "leave response_format and structured_outputs out"),
    ("POST", "/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {"name": "a b"}}],
                                      "tool_choice": "required"}, None, 400, "tools.0.function.name"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "assistant"}]}, None, 400, "needs its content"),
    ("POST", "/v1/chat/completions", {"messages": [*HI, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "a=1"}}]}]}, None, 400,
     "arguments are the text of a JSON object"),
    ("POST", "/v1/chat/completions", {"messages": [*HI, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]}, None, 400,
     "has no place for an assistant message's tool_calls"),
    ("POST", "/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {"enable_thinking": False}}, None, 400,
     "post-training's chat template reads no variables: leave chat_template_kwargs (['enable_thinking']) out"),
    ("POST", "/v1/chat/completions", {"messages": [*HI, {"role": "tool", "content": "2"}]}, None, 400,
     "a message is {'role': one of ['system', 'user', 'assistant']"),
    ("POST", "/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}, "min_tokens": 2}, None,
     400, "min_tokens with a structured output"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True,
                                      "structured_outputs": {"choice": ["a"]}}, None, 400,
     "ignore_eos with a structured output"),
    ("GET", "/v1/completions", None, None, 405, "Method Not Allowed"),
    ("POST", "/v1/embeddings", {"input": "x"}, None, 404, "Not Found"),
]


def test_bad_requests_get_4xx_that_say_what_is_wrong(served, model):
    url, _ = served
    with httpx.Client(base_url=url, timeout=60) as client:
        for method, path, body, raw, status, words in BAD:
            r = client.request(method, path, json=body, content=raw,
                               headers={"content-type": "application/json"} if raw is not None else None)
            assert r.status_code == status, (path, body or raw, r.text)
            error = r.json()["error"]
            assert words in error["message"] and error["type"], (body or raw, error)
        # curl -d sends a form's content type: the message says what to send instead
        form = client.post("/v1/completions", content=b'{"prompt": "x"}',
                           headers={"content-type": "application/x-www-form-urlencoded"})
        assert form.status_code == 400, form.text
        assert "must be a JSON object" in form.json()["error"]["message"]
        assert "Content-Type: application/json" in form.json()["error"]["message"]
        good = client.post("/v1/completions", json={"prompt": "And", "max_tokens": 2, "temperature": 0})
        assert good.status_code == 200 and good.json()["choices"][0]["text"]

    from fastapi.testclient import TestClient

    from tasks.tokenizer import build_gpt2

    base = Service(model.__class__(model.cfg, model.params, build_gpt2(("<|endoftext|>",)), model.eos_id), "base")
    with TestClient(create_app(base)) as client:  # a model whose tokenizer has no chat tokens
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "has no chat template" in r.json()["error"]["message"]


def test_kiln_serve_model_prints_its_url_and_exits_0_on_sigterm(store, tmp_path):  # noqa: F811
    port = free_port()
    log = tmp_path / "serve.log"
    ready = f"kiln serve-model: tiny at http://127.0.0.1:{port}/v1"
    command = [sys.executable, "-m", "flows.cli", "serve-model", str(store / "train" / "m0"), "--port", str(port),
               "--name", "tiny", "--max-batch", "4", "--max-model-len", "48"]
    with server("kiln serve-model", command,
                log, lambda: ready in log_tail(log), env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout_s=120) as proc:
        url = f"http://127.0.0.1:{port}/v1"
        assert f"{ready} (context 48 tokens, up to 4 prompts decoding at once; float32, weights " in log_tail(log)
        listed = httpx.get(f"{url}/models", timeout=10).json()["data"][0]
        assert (listed["id"], listed["max_model_len"]) == ("tiny", 48)  # the model's 64, capped
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # in flight (compiling) when SIGTERM comes
            answer = pool.submit(httpx.post, f"{url}/completions", json={"prompt": PROMPT, "max_tokens": 30},
                                 timeout=60)
            time.sleep(1.0)  # a fresh server compiles for seconds before it answers
            os.killpg(proc.pid, signal.SIGTERM)
            try:  # a hang, not a timing: the request in flight compiles and decodes first (10.4 s once, loaded)
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"still running 30 s after SIGTERM:\n{log_tail(log)}") from None
            assert proc.returncode == 0, log_tail(log)
            assert answer.result().status_code == 200  # the request in flight was answered
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/models", timeout=5)


def test_slots_that_do_not_fit_in_memory_are_refused_before_serving(store):  # noqa: F811
    """The key/value cache of the slots and the prefix cache are counted (nothing allocated) against
    the free memory at the start: too many slots of the whole context, or too large a prefix cache,
    are refused saying how much they need and what to lower; so is a prefix cache too small for a
    block."""
    from evaluation.server import serve_model
    from evaluation.slots import free_bytes

    free = free_bytes()
    assert free is not None and free > 0  # on this CPU: the machine's available memory
    column = 2 * 2 * 4 * 2 * 8  # a token's keys and values: 2 layers x (k, v) x 4 bytes x 2 kv heads x 8
    slots = int(2 * free // (column * 64))  # twice the memory free now: never free, however other tests run
    with pytest.raises(ValueError, match=rf"{slots} slots of 64 tokens need .* of key/value cache and the prefix "
                                         r"cache of 0 tokens 0.0 MiB, and .* is free beside the weights .*: give a "
                                         r"smaller --max-model-len, --max-batch or --prefix-cache-tokens"):
        serve_model(store / "train" / "m0", port=free_port(), max_batch=slots, prefix_tokens=0)
    tokens = int(2 * free // column)
    with pytest.raises(ValueError, match=rf"2 slots of 64 tokens need 0.0 MiB of key/value cache and the prefix "
                                         rf"cache of {tokens} tokens .* GiB, and"):
        serve_model(store / "train" / "m0", port=free_port(), max_batch=2, prefix_tokens=tokens)
    with pytest.raises(ValueError, match="a prefix cache of 31 tokens holds no block of 32: give at least 32 tokens, "
                                         "or 0 for none"):
        serve_model(store / "train" / "m0", port=free_port(), max_batch=2, prefix_tokens=31)


def test_kiln_serve_model_says_what_is_wrong_with_a_path(tmp_path):
    bad = kiln("serve-model", str(tmp_path / "nothing"), check=False)
    assert bad.returncode == 2 and "neither a training output" in bad.stderr
