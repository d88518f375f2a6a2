"""Multi-turn episodes (rollout/environments/): token in and token out against the engine's own record, every way an
environment can fail, and the rows it rejects."""

from __future__ import annotations

import json
import queue

import pytest

from rolloutpipe.control.codec import decode_group, encode_group
from rolloutpipe.model import build_tiny_tokenizer
from rolloutpipe.rollout.data import DataConfig, DatasetError, load_prompts
from rolloutpipe.rollout.engines.embedded import EmbeddedEngine
from rolloutpipe.rollout.environments.chat import TurnTemplate
from rolloutpipe.rollout.environments.config import EnvironmentConfig
from rolloutpipe.rollout.environments.episodes import Episode, EpisodeRunner
from rolloutpipe.rollout.environments.pool import EnvPool
from rolloutpipe.rollout.groups import GroupAssembler
from rolloutpipe.rollout.samples import sampling_seed
from rolloutpipe.trainer.grpo_trainer import pack, train_samples
from rolloutpipe.types import EpisodeEnd, FinishReason, GenerationRequest, GenerationResult, Prompt, turn_id
from tests.helpers.embedded import tiny_model

FIXTURES = ["tests.fixtures.environments"]


def env_config(**kw) -> EnvironmentConfig:
    return EnvironmentConfig(**({"name": "scripted", "import_modules": FIXTURES, "num_workers": 2} | kw))


@pytest.fixture
def pool(request):
    pools = []

    def make(**kw) -> EnvPool:
        pools.append(EnvPool(env_config(**kw)))
        return pools[-1]

    yield make
    for p in pools:
        p.close()


def runner_for(pool: EnvPool, *, max_response_len: int = 60, **kw) -> EpisodeRunner:
    tokenizer = build_tiny_tokenizer()

    def turn_request(episode: Episode, turn: int, input_ids: list[int], max_new_tokens: int) -> GenerationRequest:
        return GenerationRequest(
            request_id=turn_id(episode.step, episode.group, episode.sample, turn), input_ids=input_ids,
            max_new_tokens=max_new_tokens, temperature=1.0,
            sampling_seed=sampling_seed(7, episode.step, episode.group, episode.sample, turn),
            stop_token_ids=[tokenizer.eos_token_id], priority=episode.group)

    return EpisodeRunner(cfg=pool.cfg, pool=pool, tokenizer=tokenizer, stop_token_ids=[tokenizer.eos_token_id],
                         max_response_len=max_response_len, turn_request=turn_request, **kw)


def prompt(index: int, **metadata) -> Prompt:
    ids = build_tiny_tokenizer().encode("ab=", add_special_tokens=False)
    return Prompt(index=index, text="ab=", input_ids=ids, label=f"row{index}", metadata=metadata)


def scripted_result(request: GenerationRequest, output_ids: list[int]) -> GenerationResult:
    return GenerationResult(request_id=request.request_id, output_ids=output_ids,
                            output_logprobs=[-0.5] * len(output_ids), finish_reason=FinishReason.STOP,
                            policy_version=0, submitted_s=0.0, started_s=0.0, finished_s=0.0)


def play(runner: EpisodeRunner, episodes: list[Episode], outputs: list[list[int]]):
    """Drive each episode with the same scripted model turns (``outputs[t]`` for turn t): its sample."""
    samples = []
    for episode in episodes:
        request, turn = runner.first_request(episode), 0
        while isinstance(request, GenerationRequest):
            request, turn = runner.on_turn(episode, scripted_result(request, outputs[min(turn, len(outputs) - 1)])), \
                turn + 1
        samples.append(request)
    return samples


def test_trained_tokens_equal_sampled_tokens(pool):
    """Episodes of three model turns on the embedded engine: every turn's request is the prompt plus every id so far
    (never re-tokenized text), the sample's ids are the engine's outputs with the environment's turns between them,
    the mask is 1 exactly on the engine's tokens, and what the trainer packs from the group payload is that."""
    tokenizer = build_tiny_tokenizer()
    env_pool = pool()
    runner = runner_for(env_pool, max_response_len=80)
    runner.cfg.max_turn_tokens = 8
    record: dict[str, tuple[GenerationRequest, GenerationResult]] = {}
    results: queue.Queue = queue.Queue()
    engine = EmbeddedEngine(name="e", model=tiny_model(), concurrency=8, on_result=results.put)
    submitted: dict[str, GenerationRequest] = {}
    try:
        p = prompt(3, turns=3)
        episodes = {f"step=0/group=0/sample={s}": Episode(prompt=p, step=0, group=0, sample=s) for s in range(4)}
        for episode in episodes.values():
            request = runner.first_request(episode)
            submitted[request.request_id] = request
            engine.submit(request)
        assembler = GroupAssembler(step=0, policy_version=0, prompts=[p], n_samples=4, normalize_std=True)
        group = None
        while group is None:
            result = results.get(timeout=60)
            record[result.request_id] = (submitted[result.request_id], result)
            episode = episodes[result.request_id.split("/turn=")[0]]
            nxt = runner.on_turn(episode, result)
            if isinstance(nxt, GenerationRequest):
                submitted[nxt.request_id] = nxt
                engine.submit(nxt)
            else:
                group = assembler.add(nxt)
    finally:
        engine.shutdown()
    reply = [TurnTemplate(tokenizer, [tokenizer.eos_token_id]).ids([{"role": "user", "content": f"turn {t}"}])
             for t in (1, 2)]
    trained = train_samples(decode_group(encode_group(group)))
    input_ids, _, mask = pack(trained, pad_id=tokenizer.pad_token_id)
    for sample, t in zip(group.samples, trained):
        turns = [record[turn_id(0, 0, sample.index, k)] for k in range(3)]
        ids, flags, logprobs = [], [], []
        for k, (request, result) in enumerate(turns):
            assert request.input_ids == p.input_ids + ids  # token in: the conversation so far, as ids
            ids, flags = ids + result.output_ids, flags + [1] * len(result.output_ids)
            logprobs += result.output_logprobs
            if k < 2:
                ids, flags, logprobs = ids + reply[k], flags + [0] * len(reply[k]), logprobs + [0.0] * len(reply[k])
        assert (sample.response_ids, sample.response_mask, sample.logprobs) == (ids, flags, logprobs)
        assert (sample.num_turns, sample.episode_end) == (3, EpisodeEnd.done)
        assert t.response_ids == ids and t.response_mask == flags
    for b, s in enumerate(trained):
        start = len(s.prompt_ids) - 1
        assert input_ids[b, : len(s.prompt_ids) + len(s.response_ids)].tolist() == s.prompt_ids + s.response_ids
        assert mask[b].tolist() == [0.0] * start + [float(f) for f in s.response_mask] + [0.0] * (
            mask.shape[1] - start - len(s.response_mask))


@pytest.mark.parametrize("fault,end,error", [
    ("raise", EpisodeEnd.env_error, "RuntimeError: scripted failure"),
    ("non_text", EpisodeEnd.env_error, "not a list of messages with text"),
    ("crash", EpisodeEnd.env_error, "the environment worker died"),
    ("hang", EpisodeEnd.env_timeout, "timeout after 1 s"),
])
def test_a_failing_environment_ends_its_episode_with_reward_0_and_the_others_go_on(pool, fault, end, error):
    """The failing call's episode ends, counted, its reward 0 (a timeout marked as one, for reward.on_timeout); an
    episode on the same worker, halfway through, goes on where it was (rebuilt by replay after a crash or a hang
    killed its worker)."""
    env_pool = pool(num_workers=1, timeout_s=1.0)
    runner = runner_for(env_pool)
    healthy = Episode(prompt=prompt(1, turns=3), step=0, group=0, sample=0)
    request = runner.first_request(healthy)
    request = runner.on_turn(healthy, scripted_result(request, [14, 15]))  # "ab": turn 1 of 3
    failing = Episode(prompt=prompt(2, fault=fault), step=0, group=1, sample=0)
    [sample] = play(runner, [failing], [[14]])
    assert (sample.episode_end, sample.reward, sample.num_turns) == (end, 0.0, 1)
    assert error in sample.reward_error and sample.reward_timed_out == (fault == "hang")
    for _ in range(2):
        request = runner.on_turn(healthy, scripted_result(request, [14, 15]))
    assert request.episode_end is EpisodeEnd.done and request.num_turns == 3 and request.reward == 3.0, request
    reply = TurnTemplate(build_tiny_tokenizer(), [0]).ids([{"role": "user", "content": "turn 2"}])
    assert request.response_ids[-2 - len(reply):-2] == reply  # the replayed environment counted on from turn 1


def test_an_environment_reply_longer_than_the_budget_ends_the_episode_before_it(pool):
    runner = runner_for(pool(), max_response_len=60)
    [sample] = play(runner, [Episode(prompt=prompt(1, fault="flood"), step=0, group=0, sample=0)], [[14, 15]])
    assert (sample.episode_end, sample.response_ids, sample.reward_error) == (EpisodeEnd.overflow, [14, 15], None)
    assert sample.reward == 1.0  # the turn's reward stands; its reply is never appended


def test_turn_limits_and_the_token_budget_end_episodes(pool):
    env_pool = pool(max_turns=2)
    [sample] = play(runner_for(env_pool), [Episode(prompt=prompt(1, turns=5), step=0, group=0, sample=0)], [[14]])
    assert (sample.episode_end, sample.num_turns, sample.reward) == (EpisodeEnd.max_turns, 2, 2.0)
    [sample] = play(runner_for(pool(), max_response_len=3),
                    [Episode(prompt=prompt(1, turns=5), step=0, group=0, sample=0)], [[14, 15, 16]])
    assert (sample.episode_end, sample.num_turns) == (EpisodeEnd.length, 1)


def test_a_row_the_environment_rejects_is_named_before_anything_starts(tmp_path, pool):
    rows = [{"prompt": "ab=", "label": "ba"}, {"prompt": "cd=", "label": "dc", "metadata": {"reject": True}}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"environment 'scripted' rejects the row at {path}:2: ValueError: the "
                                         "scripted environment takes no row marked reject"):
        load_prompts(DataConfig(path=str(path)), build_tiny_tokenizer(), path, openings=pool().openings)


def test_an_opening_joins_the_prompt_through_the_chat_template(tmp_path, pool):
    rows = [{"prompt": "ab", "label": "ba", "metadata": {"opening": "go"}}]
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(DatasetError, match="Set data.apply_chat_template=true"):
        load_prompts(DataConfig(path=str(path)), build_tiny_tokenizer(), path, openings=pool().openings)
    [p] = load_prompts(DataConfig(path=str(path), apply_chat_template=True), build_tiny_tokenizer(), path,
                       openings=pool().openings)
    assert p.text == "<|im_start|>user:ab<|im_end|><|im_start|>user:go<|im_end|><|im_start|>assistant:"


def test_what_an_environment_run_cannot_do_is_refused_at_launch_in_one_line(monkeypatch):
    """A missing adapter's extra is named with its install command; an unknown environment without a module to
    register it, and speculation (a draft is one response), are refused before any process starts."""
    from rolloutpipe.config import Config
    from rolloutpipe.rollout.config import RolloutConfig
    from rolloutpipe.rollout.environments import base

    real = base.importlib.util.find_spec
    monkeypatch.setattr(base.importlib.util, "find_spec", lambda name: None if name == "verifiers" else real(name))
    with pytest.raises(ValueError, match=r"^environment.name=verifiers needs the verifiers package, which is not "
                                         r"installed: pip install -e '.\[verifiers\]' \(the verifiers extra\).$"):
        Config(environment=EnvironmentConfig(name="verifiers"))
    with pytest.raises(ValueError, match="list the module that registers it"):
        Config(environment=EnvironmentConfig(name="mine"))
    with pytest.raises(ValueError, match="rollout.speculative=true with an environment"):
        Config(environment=EnvironmentConfig(name="lookup"), rollout=RolloutConfig(speculative=True))
    assert Config(environment=EnvironmentConfig(name="lookup")).environment.name == "lookup"


def test_an_episode_with_a_turn_of_other_weights_reports_them_even_if_a_later_turn_has_the_first_again(pool):
    """check_on_policy must see a turn generated by other weights: a later turn back on the first's does not hide
    it."""
    from dataclasses import replace

    runner = runner_for(pool())
    episode = Episode(prompt=prompt(1, turns=3), step=0, group=0, sample=0)
    request = runner.first_request(episode)
    for version in (3, 4, 3):
        request = runner.on_turn(episode, replace(scripted_result(request, [14]), policy_version=version))
    assert request.episode_end is EpisodeEnd.done and request.policy_version == 4
