"""Sampling as Tinker serves it (docs/api.md, "Sampling"): stop strings matched on the decoded text (the tokens that
spell one stay in the result, stop reason ``stop``), stop token ids, EOS by default and never with ``stop=[]``,
``num_samples``, ``topk_prompt_logprobs`` in the SDK's own ``TopkLogprobs`` form, and seeds that reproduce.

The stop strings are cut from the greedy continuation of the tiny model itself, so every expectation is exact: the
sequence is the greedy one up to and including the token that completes the first stop string.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest

from tests.api_inproc import BASE, OWNER, wait

PROMPT = [5, 17, 42, 9, 3]
N = 16


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.api_inproc import service

    with service(tmp_path_factory.mktemp("sampling"), "api:\n  max_sample_tokens: 32\n") as s:
        yield s


def _sample(svc: Any, num_samples: int = 1, **params: Any) -> Any:
    """The SDK's SampleResponse (parsed by its own protobuf reader) of a base-model sample, or the refusal text."""
    from tinker import types
    from tinker.proto.response_conv import deserialize_sample_response

    from app.api.errors import ApiError

    topk = params.pop("topk_prompt_logprobs", 0)
    plp = params.pop("prompt_logprobs", None)
    req = types.SampleRequest(prompt=types.ModelInput.from_ints(PROMPT), num_samples=num_samples, base_model=BASE,
                              sampling_params=types.SamplingParams(**params), topk_prompt_logprobs=topk,
                              prompt_logprobs=plp)
    try:
        fut = svc.sample(OWNER, req)
    except ApiError as exc:
        return str(exc)
    ok, body = wait(svc, fut)
    return deserialize_sample_response(body) if ok else json.loads(body)["error"]


def _greedy(svc: Any, **params: Any) -> tuple[list[int], str]:
    got = _sample(svc, max_tokens=N, temperature=0.0, **params)
    return got.sequences[0].tokens, got.sequences[0].stop_reason


@pytest.fixture(scope="module")
def greedy(svc: Any) -> list[int]:
    """The tiny model's greedy continuation of PROMPT, never stopped early (``stop=[]``)."""
    tokens, reason = _greedy(svc, stop=[])
    assert len(tokens) == N and reason == "length"
    return tokens


def _tok(svc: Any) -> Any:
    """The served base model's tokenizer (what the sampler matches stop strings on)."""
    from app.api.engine.sampling import tokenizer_of

    return tokenizer_of(str(svc.engine.base_dir))


def _texts(svc: Any, tokens: list[int]) -> list[str]:
    """The decoded text after each token: texts[i] is the text of tokens[:i + 1]."""
    tok = _tok(svc)
    return [tok.decode(tokens[:i + 1]) for i in range(len(tokens))]


def _first_end(texts: list[str], stop: str) -> int:
    """Index of the token whose text first holds ``stop`` (the earlier texts do not)."""
    return next(i for i, t in enumerate(texts) if stop in t)


def test_a_stop_string_spanning_two_tokens_ends_after_the_second(svc: Any, greedy: list[int]) -> None:
    texts = _texts(svc, greedy)
    pieces = [_tok(svc).decode([t]) for t in greedy]
    # the last character of token i and the first of token i+1, not found earlier in the text
    i = next(i for i in range(1, N - 2) if pieces[i] and pieces[i + 1]
             and (pieces[i][-1] + pieces[i + 1][0]) not in texts[i])
    stop = pieces[i][-1] + pieces[i + 1][0]
    assert _first_end(texts, stop) == i + 1
    tokens, reason = _greedy(svc, stop=[stop])
    assert (tokens, reason) == (greedy[:i + 2], "stop")
    assert stop not in pieces[i] and stop not in pieces[i + 1]  # it spans the two tokens


def test_a_stop_string_that_is_a_prefix_of_a_tokens_text_ends_with_that_token(svc: Any, greedy: list[int]) -> None:
    texts = _texts(svc, greedy)
    pieces = [_tok(svc).decode([t]) for t in greedy]
    j = next(j for j in range(1, N - 1) if len(pieces[j]) >= 2 and pieces[j][:-1] not in texts[j - 1]
             and pieces[j][:-1] not in texts[j - 1] + pieces[j][:-2])
    stop = pieces[j][:-1]
    tokens, reason = _greedy(svc, stop=stop)  # a single string, as SamplingParams allows
    assert (tokens, reason) == (greedy[:j + 1], "stop")
    assert not _tok(svc).decode(tokens).endswith(stop)  # the whole token stays, past the stop string


def test_several_stop_strings_stop_at_the_first_occurrence(svc: Any, greedy: list[int]) -> None:
    texts = _texts(svc, greedy)
    pieces = [_tok(svc).decode([t]) for t in greedy]
    late, early = pieces[N - 2] + pieces[N - 1], pieces[3]
    end = min(_first_end(texts, late), _first_end(texts, early))
    assert end < N - 1
    tokens, reason = _greedy(svc, stop=[late, early])
    assert (tokens, reason) == (greedy[:end + 1], "stop")
    assert _greedy(svc, stop=[early, late]) == (tokens, reason)  # the order of the list does not matter


def test_a_stop_string_never_produced_runs_to_max_tokens(svc: Any, greedy: list[int]) -> None:
    assert _greedy(svc, stop=["\u2603 not in this text"]) == (greedy, "length")


def test_stop_token_ids_end_with_the_token(svc: Any, greedy: list[int]) -> None:
    k = 6
    assert greedy[k] not in greedy[:k]
    assert _greedy(svc, stop=[greedy[k]]) == (greedy[:k + 1], "stop")


def test_none_stops_at_eos_and_the_empty_list_never_stops(svc: Any) -> None:
    from app.api.engine.sampling import Stop, eos_ids, stop_of

    eos = eos_ids(svc.engine.model.config, _tok(svc), svc.engine.vocab)
    assert eos == {_tok(svc).eos_token_id}
    assert stop_of(None, eos) == Stop(tokens=eos)
    assert stop_of([], eos) == Stop()
    assert stop_of(["\n\nUser:"], eos) == Stop(tokens=eos, strings=("\n\nUser:",))
    assert stop_of([7, 9], eos) == Stop(tokens=eos | {7, 9})


@pytest.mark.parametrize("stop, reason", [
    (["a", 3], "strings or token ids, not both"),
    ([""], "empty string"),
])
def test_bad_stops_are_refused_before_queueing(svc: Any, stop: Any, reason: str) -> None:
    from tinker import types

    from app.api.errors import BadRequest

    params = types.SamplingParams.model_construct(max_tokens=4, stop=stop)  # as a raw request may send it
    req = types.SampleRequest(prompt=types.ModelInput.from_ints(PROMPT), base_model=BASE, sampling_params=params)
    with pytest.raises(BadRequest, match=reason):
        svc.sample(OWNER, req)


def test_num_samples_each_get_a_sequence(svc: Any) -> None:
    got = _sample(svc, num_samples=3, max_tokens=5, temperature=1.0, seed=11, stop=[])
    assert [len(s.tokens) for s in got.sequences] == [5, 5, 5]
    assert all(len(s.logprobs) == 5 and all(lp <= 0 for lp in s.logprobs) for s in got.sequences)
    assert len({tuple(s.tokens) for s in got.sequences}) > 1


def test_a_seed_reproduces_its_tokens_and_no_seed_is_random(svc: Any) -> None:
    def tokens(seed: int | None) -> list[list[int]]:
        got = _sample(svc, num_samples=2, max_tokens=8, temperature=1.0, seed=seed, stop=[])
        return [s.tokens for s in got.sequences]

    assert tokens(1234) == tokens(1234)
    assert tokens(1234) != tokens(1235)
    assert tokens(None) != tokens(None)


def test_topk_prompt_logprobs_come_in_the_sdks_form(svc: Any) -> None:
    got = _sample(svc, max_tokens=1, prompt_logprobs=True, topk_prompt_logprobs=3)
    top, plp = got.topk_prompt_logprobs, got.prompt_logprobs
    assert len(top) == len(plp) == len(PROMPT) and top[0] is None and plp[0] is None
    for i in range(1, len(PROMPT)):
        ids = [t for t, _ in top[i]]
        lps = [lp for _, lp in top[i]]
        assert len(ids) == 3 == len(set(ids)) and lps == sorted(lps, reverse=True) and lps[0] <= 0
        assert plp[i] <= lps[0] + 1e-5
        if PROMPT[i] in ids:
            assert math.isclose(lps[ids.index(PROMPT[i])], plp[i], abs_tol=1e-4)
        else:
            assert plp[i] <= lps[-1] + 1e-5
    only_topk = _sample(svc, max_tokens=1, topk_prompt_logprobs=2)
    assert only_topk.prompt_logprobs is None and [r and len(r) for r in only_topk.topk_prompt_logprobs][1:] == [2] * 4


@pytest.mark.parametrize("field, value", [("topk_prompt_logprobs", 21), ("topk_sample_logprobs", 2),
                                          ("prompt_alt_tokens_k", 2)])
def test_what_is_not_served_is_refused(svc: Any, field: str, value: int) -> None:
    from tinker import types

    from app.api.errors import BadRequest

    req = types.SampleRequest(prompt=types.ModelInput.from_ints(PROMPT), base_model=BASE,
                              sampling_params=types.SamplingParams(max_tokens=4), **{field: value})
    with pytest.raises(BadRequest, match=field):
        svc.sample(OWNER, req)
