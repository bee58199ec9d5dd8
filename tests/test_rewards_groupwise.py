"""Groupwise and pairwise rewards and the latent reward head: PickScore_Rank against Flow-Factory's
rank formula, the Pref-GRPO win rate from a real tiny VLM behind an OpenAI-compatible server, the
typed errors (a split group, a judge answering for another pair, a latent head on decoded media),
and one in-process step on tiny_t2i: the real embedded engine's groups, decoded by the family's
VAE, scored by the scorer stage's batch function, into a FlowGRPO update.

References:
- Flow-Factory (X-GenGroup/Flow-Factory, src/flow_factory/rewards/pick_score.py, commit
  73ddbdc1a10441fbbafd73c4accc7924d9507266, PickScoreRankRewardModel.__call__):
      ranks = raw_scores.argsort().argsort(); rewards = ranks.float() / group_size
- Pref-GRPO (CodeGoat24/Pref-GRPO, fastvideo/rewards/unifiedreward_think.py, commit
  3e787f6dd5a3051b40d61f07e9578468ac26130a, `_pairwise_win_rate`): wins over comparisons, every
  pair once, no conclusion = half a win each (our `undecided: tie`); and from the tiny judge's
  recorded answers end to end.
"""
from __future__ import annotations

import asyncio
import copy
import itertools

import pytest
import torch

from contract import (ArtifactSpec, ConfigError, MediaArtifact, MediaFormatError, RewardReport,
                      RolloutOutput, ScoreStatus)
from contract.errors import GroupSplitError, RemoteScorerError
from rewards.base import ScoreRequest
from rewards.groupwise import rank_in_group
from rewards.pairwise import VLMPairwiseScorer, VLMPairwiseScorerConfig, win_rates
from rewards.registry import ScorerSpec, build_scorer

torch.set_num_threads(1)
IMAGE = ArtifactSpec("image", "image", "decoded", "CHW", source="image_latent")
LATENT = ArtifactSpec("image_latent", "image", "latent", "latent:CHW")


def _images(n, seed=0, h=32, w=32):
    g = torch.Generator().manual_seed(seed)
    return {"image": MediaArtifact(IMAGE, torch.randint(0, 256, (n, 3, h, w), generator=g,
                                                        dtype=torch.uint8))}


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    from testing import preference_snapshots as ps
    return ps.write_hf_clip_dir(tmp_path_factory.mktemp("groupwise") / "clip")


@pytest.fixture(scope="module")
def rank_scorer(clip_dir):
    return build_scorer(ScorerSpec(kind="pickscore_rank", params={"model_dir": clip_dir}))


def test_rank_equals_flow_factorys_argsort_formula():
    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 8, 17):
        scores = torch.randn(n, generator=g)
        reference = scores.argsort().argsort().float() / n        # Flow-Factory (distinct scores)
        torch.testing.assert_close(rank_in_group(scores), reference, rtol=0, atol=0)
    # ties: ordered by position (a stable sort), so the ranks stay a permutation
    assert rank_in_group(torch.tensor([1.0, 1.0, 0.0])).tolist() == pytest.approx([1 / 3, 2 / 3, 0])


def test_pickscore_rank_ranks_pickscore_within_each_group(rank_scorer, clip_dir):
    pick = build_scorer(ScorerSpec(kind="pickscore", params={"model_dir": clip_dir}))
    prompts = ("a red cat",) * 3 + ("a blue dog",) * 4
    arts = _images(7)
    out = rank_scorer.score(ScoreRequest(arts, prompts, groups=(3, 4)))
    values = torch.tensor(pick.score(ScoreRequest(arts, prompts)).scores["pickscore"])
    assert out.scores["pickscore"] == pytest.approx(values.tolist(), abs=1e-6)
    expected = torch.cat([values[:3].argsort().argsort() / 3, values[3:].argsort().argsort() / 4])
    assert out.scores["rank"] == pytest.approx(expected.tolist(), abs=0)
    assert rank_scorer.primary == "rank" and out.status == (ScoreStatus.OK,) * 7


@pytest.mark.parametrize("groups, field", [((), "pickscore_rank.groups"),
                                           ((3, 3), "pickscore_rank.groups"),
                                           ((1, 3), "pickscore_rank.groups[0]")])
def test_a_split_or_undeclared_group_is_refused(rank_scorer, groups, field):
    with pytest.raises(GroupSplitError) as e:
        rank_scorer.score(ScoreRequest(_images(4), ("a cat",) * 4, groups=groups))
    assert e.value.field == field and e.value.http_status == 422


def test_groupwise_scorer_on_video_frames_is_a_config_error(clip_dir):
    from deployments.config import load_graph_config
    with pytest.raises(ConfigError) as e:
        load_graph_config({"scorers": [{"name": "r", "inputs": ["video"], "scorer": {
            "kind": "pickscore_rank", "params": {"model_dir": clip_dir},
            "video": {"num_frames": 2}}}]})
    assert "scorer" in e.value.field and "groupwise" in e.value.message


def test_scorer_stage_batch_keeps_each_request_its_own_group(rank_scorer, clip_dir):
    """The scorer stage's micro-batch (two calls in one forward) ranks each call's samples among
    themselves: the same ranks as each request scored alone."""
    from deployments.config import ScorerStage
    from deployments.scorer import ScorerServer, _Pending
    stage = ScorerServer.__new__(ScorerServer)           # the stage's own batch path, no replica
    stage.spec = ScorerStage(name="pickscore_rank", inputs=("image",),
                             scorer={"kind": "pickscore_rank", "params": {"model_dir": clip_dir}})
    stage.scorer = rank_scorer
    from deployments.metrics import StageMetrics
    stage.metrics = StageMetrics("scorer:test")
    a, b = _images(3, seed=1), _images(4, seed=2)
    reqs = [ScoreRequest(a, ("a cat",) * 3, groups=(3,)), ScoreRequest(b, ("a dog",) * 4,
                                                                      groups=(4,))]
    batched = asyncio.run(ScorerServer._score_batch.__wrapped__(stage,
                                                                [_Pending(r) for r in reqs]))
    for req, out in zip(reqs, batched):
        assert out.scores["rank"] == rank_scorer.score(req).scores["rank"]


# ---- pairwise: Pref-GRPO's win rate, then a real tiny VLM behind an OpenAI-compatible server ----
def ref_pairwise_win_rate(num_items, responses):
    """Excerpt of Pref-GRPO's `_pairwise_win_rate` (CodeGoat24/Pref-GRPO,
    fastvideo/rewards/unifiedreward_think.py, commit 3e787f6dd5a3051b40d61f07e9578468ac26130a),
    the answer parsed beforehand: 1, 2 or None (no conclusion)."""
    from collections import defaultdict
    win_count, compare_count = defaultdict(int), defaultdict(int)
    for result in responses:
        idx1, idx2 = result["first_index"], result["second_index"]
        compare_count[idx1] += 1
        compare_count[idx2] += 1
        if result["better"] == 1:
            win_count[idx1] += 1
        elif result["better"] == 2:
            win_count[idx2] += 1
        else:
            win_count[idx1] += 0.5
            win_count[idx2] += 0.5
    return [round(win_count[idx] / compare_count[idx], 3) if compare_count[idx] > 0 else 0.0
            for idx in range(num_items)]


def test_win_rates_equal_pref_grpos_on_random_outcomes():
    from rewards.pairwise import Undecided
    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 5, 8):
        pairs = list(itertools.combinations(range(n), 2))
        better = torch.randint(0, 3, (len(pairs),), generator=g).tolist()   # 0: undecided
        responses = [{"first_index": i, "second_index": j, "better": b or None}
                     for (i, j), b in zip(pairs, better)]
        winners = {(i, j): (None if b == 0 else (i if b == 1 else j))
                   for (i, j), b in zip(pairs, better)}
        ours = win_rates(n, winners, Undecided.TIE)
        assert ours == pytest.approx(ref_pairwise_win_rate(n, responses), abs=5e-4)  # it rounds
        failed = win_rates(n, winners)            # the default: an undecided pair fails both
        for (i, j), b in zip(pairs, better):
            if b == 0:
                assert failed[i] is None and failed[j] is None



@pytest.fixture(scope="module")
def judge_server():
    from testing.http_servers import serve
    from tests.tiny_vlm_server import TinyVLMServer
    server = TinyVLMServer()
    with serve(server.app()) as url:
        yield server, url


def test_pairwise_win_rates_follow_the_judges_answers(judge_server):
    server, url = judge_server
    scorer = build_scorer(ScorerSpec(kind="vlm_pairwise", params={
        "base_url": f"{url}/v1", "model": "tiny-llava"}))
    arts = _images(5, seed=3)
    prompts = ("a red cat",) * 2 + ("a blue dog",) * 3
    before = len(server.exchanges)
    out = scorer.score(ScoreRequest(arts, prompts, groups=(2, 3)))
    exchanges = server.exchanges[before:]
    assert len(exchanges) == 1 + 3 and out.metadata["pairs"] == 4
    # the calls run concurrently, so each answer is matched to its pair by the request's own text
    answers = {}
    for body, answer in exchanges:
        text = body["messages"][-1]["content"][-1]["text"]
        i, j = (int(c) for c in body["structured_outputs"]["choice"])
        assert f"image {i}" in text and f"image {j}" in text
        prompt = next(p for p in set(prompts) if f'"{p}"' in text)
        answers[prompt, i, j] = int(answer)
    # the derivation: per group, each sample's wins over the other n - 1, from the answers
    expected = []
    for start, n in ((0, 2), (2, 3)):
        wins = [0] * n
        for i, j in itertools.combinations(range(n), 2):
            wins[answers.pop((prompts[start], i, j))] += 1
        expected += [w / (n - 1) for w in wins]
    assert not answers
    assert out.scores["win_rate"] == pytest.approx(expected)
    assert sum(out.scores["win_rate"][2:]) == pytest.approx(1.5)   # 3 comparisons, 1 win each


def test_a_judge_answering_for_another_pair_is_a_typed_error(judge_server):
    _, url = judge_server
    scorer = VLMPairwiseScorer(VLMPairwiseScorerConfig(base_url=f"{url}/v1", model="tiny-llava"))
    with pytest.raises(RemoteScorerError) as e:
        scorer.winner("Image 3 is better", (0, 1), group=2)
    assert e.value.field == "vlm_pairwise.groups[2].pairs[0,1]" and e.value.actual == 3
    assert scorer.winner("1", (0, 1), 0) == 1 and scorer.winner("neither", (0, 1), 0) is None
    assert win_rates(3, {(0, 1): 0, (0, 2): None, (1, 2): 2}) == [None, 0.0, None]
    with pytest.raises(ConfigError):
        build_scorer(ScorerSpec(kind="vlm_pairwise", params={
            "base_url": url, "model": "m", "template": "no labels {prompt}"}))


# ---- the latent head ---------------------------------------------------------------------------
def _write_head(path, channels=4, hidden=6, seed=0):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    tensors = {"proj.weight": torch.randn(hidden, channels, generator=g),
               "proj.bias": torch.randn(hidden, generator=g),
               "out.weight": torch.randn(1, hidden, generator=g),
               "out.bias": torch.randn(1, generator=g)}
    save_file(tensors, str(path))
    return tensors


def test_latent_head_formula_and_typed_errors(tmp_path):
    w = _write_head(tmp_path / "head.safetensors")
    scorer = build_scorer(ScorerSpec(kind="latent_head",
                                     params={"head_path": str(tmp_path / "head.safetensors")}))
    z = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    out = scorer.score(ScoreRequest({"image_latent": MediaArtifact(LATENT, z)}, ("p",) * 3))
    pooled = z.mean(dim=(2, 3))
    hidden = 0.5 * (pooled @ w["proj.weight"].T + w["proj.bias"]) * (
        1 + torch.erf((pooled @ w["proj.weight"].T + w["proj.bias"]) / 2 ** 0.5))
    expected = hidden @ w["out.weight"][0] + w["out.bias"][0]
    assert out.scores["latent_reward"] == pytest.approx(expected.tolist(), rel=1e-5)
    with pytest.raises(MediaFormatError) as e:       # decoded media where the latent belongs
        scorer.score(ScoreRequest({"image_latent": MediaArtifact(IMAGE, torch.zeros(
            3, 3, 8, 8, dtype=torch.uint8))}, ("p",) * 3))
    assert e.value.field == "latent_head.artifacts.image_latent.representation"
    with pytest.raises(MediaFormatError) as e:       # channels the head does not read
        scorer.score(ScoreRequest({"image_latent": MediaArtifact(LATENT, torch.zeros(
            3, 16, 8, 8))}, ("p",) * 3))
    assert e.value.field == "latent_head.artifacts.image_latent.shape"
    bad = dict(w, **{"out.bias": torch.zeros(2)})
    from safetensors.torch import save_file
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ConfigError) as e:
        build_scorer(ScorerSpec(kind="latent_head",
                                params={"head_path": str(tmp_path / "bad.safetensors")}))
    assert e.value.field == "latent_head.head_path.out.bias"


# ---- one in-process step: engine groups -> decode -> scorer stage -> FlowGRPO update -----------
@pytest.fixture(scope="module")
def tiny():
    from adapters.tiny_t2i import TinyT2IFamily
    from rollout.engine import EmbeddedEngine
    from trainer.config import SamplerSettings, TrainerConfig
    from trainer.learner import Learner
    adapter = TinyT2IFamily()
    transformers = adapter.load_transformers()
    engine = EmbeddedEngine(adapter, copy.deepcopy(transformers), {})
    cfg = TrainerConfig(algorithm="flow_grpo", samples_per_prompt=4, prompts_per_step=2,
                        sampler=SamplerSettings(num_steps=4, window=(1, 2)),
                        flow_grpo={"old_log_probs": "recompute", "clip_range": 0.2})
    learner = Learner(adapter, transformers, adapter.load_encoders(), cfg.lora, cfg.optimizer)
    yield adapter, engine, cfg, learner
    asyncio.run(engine.shutdown())


def test_new_rewards_drive_a_training_step(tiny, rank_scorer, judge_server, clip_dir, tmp_path):
    """PickScore_Rank, the pairwise judge's win rate, GenEval and the latent head score the
    engine's groups (decoded by the family's VAE) and their total trains one FlowGRPO step."""
    from contract import Algorithm
    from tests.test_trainer_local import _rollout
    from trainer.prompts import captions, make_requests
    from trainer.config import PromptSource
    from trainer.rollout_batch import build_batch
    from trainer.updates import UPDATES
    adapter, engine, cfg, learner = tiny
    tensors, scale = learner.export()
    engine.load_lora("gw-v0", tensors, scale)
    prompts = adapter.conditioner.tokenize(captions(PromptSource.SHAPES, 2, 3))
    requests = make_requests(adapter, prompts, cfg.sampler, 4, 0, "gw-v0")
    results = _rollout(adapter, engine, learner, "gw-v0", requests, prompts)
    _write_head(tmp_path / "head.safetensors")
    latent = build_scorer(ScorerSpec(kind="latent_head", params={
        "head_path": str(tmp_path / "head.safetensors")}))
    from testing.detector_snapshots import write_tiny_detr
    pairwise = build_scorer(ScorerSpec(kind="vlm_pairwise", params={
        "base_url": f"{judge_server[1]}/v1", "model": "tiny-llava"}))
    geneval = build_scorer(ScorerSpec(kind="geneval", params={
        "detector_dir": write_tiny_detr(tmp_path / "detr", ("circle", "square", "triangle")),
        "detector": "object_detection", "clip_dir": clip_dir, "threshold": 0.0}))
    vae = adapter.load_decoder("image_latent")
    outputs = []
    for req, res in zip(requests, results):
        z = res.latents["image_latent"]
        image = MediaArtifact(IMAGE, adapter.codec.decode("image_latent", vae, z.data,
                                                          req.sampling))
        text = (req.prompt.text or "",) * 4
        meta = ({"tag": "single_object", "prompt": text[0],
                 "include": [{"class": "circle", "count": 1}]},) * 4
        scored = {"rank": rank_scorer.score(ScoreRequest({"image": image}, text, groups=(4,))),
                  "latent": latent.score(ScoreRequest({"image_latent": z}, text, groups=(4,))),
                  "pairwise": pairwise.score(ScoreRequest({"image": image}, text, groups=(4,))),
                  "geneval": geneval.score(ScoreRequest({"image": image}, text, meta))}
        assert sorted(scored["rank"].scores["rank"]) == [0.0, 0.25, 0.5, 0.75]
        assert sum(scored["pairwise"].scores["win_rate"]) == pytest.approx(2.0)  # 6 pairs / 3
        assert set(scored["geneval"].scores["correct"]) <= {0.0, 1.0}
        values = {k: out.scores[getattr({"rank": rank_scorer, "latent": latent,
                                         "pairwise": pairwise, "geneval": geneval}[k], "primary")]
                  for k, out in scored.items()}
        total = tuple(sum(v) for v in zip(*values.values()))
        report = RewardReport(scored, total, {k: 1.0 for k in scored}, values)
        outputs.append(RolloutOutput(req.request_id, dict(res.latents), res.trajectory,
                                     res.policy_version, req.sampling.seeds, rewards=report))
    batch = build_batch(learner, prompts, outputs, [r.sampling for r in requests])
    before = [p.detach().clone() for p in learner.params]
    metrics = UPDATES[Algorithm.FLOW_GRPO](learner, batch, cfg, torch.Generator().manual_seed(0))
    assert metrics["grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))
    # the step's report (trainer/reporting.py): distinct ranks tie no group
    assert metrics["zero_adv_group_share"] == 0.0 and metrics["dropped_group_share"] == 0.0
    assert metrics["flow_grpo/ratio_mean"] == metrics["ratio_mean"]
    assert metrics["flow_grpo/clipfrac"] == metrics["clipfrac"]


def test_ingress_plans_no_decode_for_a_latent_scorer_and_refuses_a_group_of_one(clip_dir,
                                                                                tmp_path):
    """The ingress's own decisions, in-process (the deployed twin: test_rewards_graph_groupwise):
    a latent-reading scorer adds no decode; a groupwise scorer refuses a one-sample request
    before any stage, naming sampling.seeds."""
    from adapters.tiny_t2i import TinyT2IFamily
    from contract import InvalidRequestError, RolloutRequest, SamplingSpec, Task
    from deployments.config import load_graph_config
    from deployments.ingress import RolloutGraph
    _write_head(tmp_path / "head.safetensors")
    latent = {"name": "latent", "inputs": ["image_latent"], "scorer": {
        "kind": "latent_head", "params": {"head_path": str(tmp_path / "head.safetensors")}}}
    rank = {"name": "rank", "inputs": ["image"],
            "scorer": {"kind": "pickscore_rank", "params": {"model_dir": clip_dir}}}
    family = TinyT2IFamily()

    def ingress(scorers):
        graph = RolloutGraph.__new__(RolloutGraph)
        graph.config = load_graph_config({"rollout": {"adapter": "tiny_t2i"},
                                          "scorers": scorers})
        graph.family, graph.io_spec = family, family.io_spec
        return graph
    assert ingress([latent])._decoded_plan(("image_latent",)) == {}
    assert ingress([latent, rank])._decoded_plan(("image_latent",)) == {
        "image_latent": ("image",)}
    bundle = family.conditioner.tokenize(["a red circle at the top left"])[0]
    one = RolloutRequest(prompt=bundle, task=Task.T2I,
                         sampling=SamplingSpec(num_steps=4, seeds=(3,)))
    with pytest.raises(InvalidRequestError) as e:
        ingress([latent, rank])._validate(one)
    assert e.value.field == "sampling.seeds" and e.value.actual == 1
    ingress([latent])._validate(one)              # a pointwise graph takes it


def test_a_trainer_evaluating_groups_of_one_with_a_groupwise_scorer_is_refused(clip_dir):
    from deployments.config import load_graph_config
    from trainer.config import TrainerConfig, check_group_sizes
    graph = load_graph_config({"rollout": {"adapter": "tiny_t2i"}, "scorers": [
        {"name": "rank", "inputs": ["image"],
         "scorer": {"kind": "pickscore_rank", "params": {"model_dir": clip_dir}}}]})
    with pytest.raises(ConfigError) as e:
        check_group_sizes(TrainerConfig(eval={"samples_per_prompt": 1}), graph)
    assert e.value.field == "eval.samples_per_prompt" and e.value.actual == 1
    check_group_sizes(TrainerConfig(eval={"samples_per_prompt": 2}), graph)
    check_group_sizes(TrainerConfig(eval={"samples_per_prompt": 1}),
                      load_graph_config({"rollout": {"adapter": "tiny_t2i"}}))
