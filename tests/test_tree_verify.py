"""Token tree layout invariants and the verifiers, on synthetic logits (no model needed)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from ouroboros_local.errors import ParameterError
from ouroboros_local.sampling import SamplingParams, distribution, residual, sample
from ouroboros_local.testing.lossless import assert_follows
from ouroboros_local.tree import ExtraToken, TokenTree, check_layout, layout
from ouroboros_local.verify import verify_greedy, verify_sampling


def random_tree(rng: np.random.Generator, n_nodes: int, vocab: int = 6) -> TokenTree:
    tree = TokenTree.rooted_at(int(rng.integers(vocab)))
    while tree.n_candidates < n_nodes:
        parent = int(rng.integers(len(tree)))
        tree.add(parent, int(rng.integers(vocab)))
    return tree


@pytest.mark.parametrize("seed", range(40))
def test_layout_invariants_hold_for_random_trees(seed: int) -> None:
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, int(rng.integers(0, 25)))
    lay = layout(tree)
    check_layout(lay)
    assert lay.n_seqs == len(tree.leaves())
    # every node's sequences are exactly the leaves below it
    for node in range(len(tree)):
        below = {s for leaf, s in lay.leaf_seq.items() if node in tree.path_to(leaf)}
        assert set(lay.seq_ids[node]) == below
        assert lay.pos_offsets[node] == tree.depths[node]


def test_check_layout_catches_a_bad_shared_token() -> None:
    tree = TokenTree.rooted_at(1)
    a = tree.add(0, 2)
    tree.add(a, 3)
    tree.add(0, 4)
    lay = layout(tree)
    # give node 'a' (depth 1, seq 0) also seq 1 whose depth-1 cell is another token: views differ
    bad_seqs = list(lay.seq_ids)
    bad_seqs[2] = (0, 1)  # the depth-2 token now claims seq 1 too
    lay.seq_ids = bad_seqs
    with pytest.raises(AssertionError):
        check_layout(lay)


def test_add_path_shares_prefixes_and_respects_limits() -> None:
    tree = TokenTree.rooted_at(0)
    tree.add_path(0, [1, 2, 3])
    tree.add_path(0, [1, 2, 4])
    tree.add_path(0, [5, 6], max_nodes=5)   # room for one more node only
    assert tree.tokens == [0, 1, 2, 3, 4, 5]
    assert tree.n_candidates == 5
    assert sorted(tree.leaves()) == [3, 4, 5]


@pytest.mark.parametrize("seed", range(10))
def test_child_with_token_is_the_lowest_matching_child(seed: int) -> None:
    # the O(1) index must agree with a scan, also for stochastic duplicates (add with draft_probs) and
    # for nodes appended to the lists directly
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, 12, vocab=4)
    for _ in range(12):
        parent, token = int(rng.integers(len(tree))), int(rng.integers(4))
        if rng.random() < 0.3:
            tree.add(parent, token, draft_probs=np.ones(4) / 4)
        elif rng.random() < 0.5:
            tree.tokens.append(token)
            tree.parents.append(parent)
            tree.depths.append(tree.depths[parent] + 1)
        else:
            tree.add(parent, token)
        for p in range(len(tree)):
            for t in range(4):
                scan = [i for i in range(p + 1, len(tree)) if tree.parents[i] == p and tree.tokens[i] == t]
                assert tree.child_with_token(p, t) == (scan[0] if scan else None)


def test_extras_get_their_own_sequences_and_the_root_carries_them() -> None:
    tree = TokenTree.rooted_at(7)
    tree.add_path(0, [1, 2])
    tree.extras = [ExtraToken(9, 1, (0,)), ExtraToken(8, 2, (0,)), ExtraToken(6, 1, (1,))]
    tree.n_extra_seqs = 2
    lay = layout(tree)
    check_layout(lay)
    assert lay.seq_ids[0] == (0, 1, 2)
    assert lay.seq_ids[3:] == [(1,), (1,), (2,)]
    assert lay.extra_rows == [3, 4, 5]


def onehot_rows(tree: TokenTree, target_next: dict[tuple[int, ...], int], vocab: int) -> np.ndarray:
    """Rows whose argmax is what a fake target predicts after each node's path."""
    rows = np.zeros((len(tree), vocab), dtype=np.float32)
    for node in range(len(tree)):
        prefix = tuple(tree.tokens[i] for i in tree.path_to(node))
        rows[node, target_next.get(prefix, 0)] = 5.0
    return rows


def test_greedy_verify_follows_the_target_and_picks_the_longest_branch() -> None:
    tree = TokenTree.rooted_at(1)
    tree.add_path(0, [2, 3, 9])      # right, right, wrong
    tree.add_path(0, [2, 3, 4, 5])   # right x4
    tree.add_path(0, [7])            # wrong
    truth = {(1,): 2, (1, 2): 3, (1, 2, 3): 4, (1, 2, 3, 4): 5, (1, 2, 3, 4, 5): 6}
    path, bonus, preds = verify_greedy(tree, onehot_rows(tree, truth, 10))
    assert [tree.tokens[i] for i in path] == [1, 2, 3, 4, 5]
    assert bonus == 6
    assert preds[0] == 2


def test_greedy_verify_with_nothing_accepted_returns_the_bonus() -> None:
    tree = TokenTree.rooted_at(1)
    tree.add_path(0, [3, 4])
    path, bonus, _ = verify_greedy(tree, onehot_rows(tree, {(1,): 2}, 10))
    assert path == [0] and bonus == 2


def test_sampling_params_validation() -> None:
    for bad in (dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5),
                dict(min_p=1.0), dict(top_k=-3), dict(top_k=-2), dict(seed="x"), dict(seed=-2),
                # ints no float holds raised a bare OverflowError
                dict(temperature=10**400), dict(top_p=10**400), dict(min_p=-10**400)):
        with pytest.raises(ParameterError):
            SamplingParams(**bad)   # when made, as the README says, not at the first generation
    assert SamplingParams(seed=-1).validated().seed is None   # random, as the command line and server take it
    assert SamplingParams(top_k=-1).validated().top_k == 0     # off, as the server (and vLLM) take it
    assert SamplingParams(temperature=1).validated().temperature == 1.0


def test_distribution_applies_top_k_top_p_min_p_and_temperature() -> None:
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03]))
    p = distribution(logits, SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0))
    assert np.count_nonzero(p) == 3 and abs(p.sum() - 1) < 1e-12
    p = distribution(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0))
    assert np.count_nonzero(p) == 2  # 0.5 + 0.25 reaches 0.7
    p = distribution(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.35))
    assert np.count_nonzero(p) == 2  # 0.25 >= 0.35 * 0.5
    hot = distribution(logits, SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0))
    cold = distribution(logits, SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0))
    assert hot[0] < 0.5 < cold[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the smallest temperature printed numpy's overflow warning
        frozen = distribution(logits, SamplingParams(temperature=5e-324, top_k=0, top_p=1.0, min_p=0.0))
    assert frozen.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_residual_is_the_positive_part() -> None:
    p = np.array([0.5, 0.5, 0.0])
    q = np.array([0.8, 0.1, 0.1])
    assert np.allclose(residual(p, q), [0.0, 1.0, 0.0])
    assert residual(p, p) is None


def test_the_losslessness_check_passes_exact_samples_and_rejects_a_small_bias() -> None:
    """The check the sampling tests rely on has the power they assume: 8000 draws with 3% of the
    mass moved between two outcomes fail, exact draws pass, an impossible outcome fails at once."""
    rng = np.random.default_rng(3)
    probs = np.array([0.4, 0.3, 0.2, 0.1, 0.0])
    biased = probs + np.array([0.03, -0.03, 0.0, 0.0, 0.0])
    assert assert_follows(np.bincount(rng.choice(5, 8000, p=probs), minlength=5), probs) > 1e-3
    with pytest.raises(AssertionError, match="do not follow"):
        assert_follows(np.bincount(rng.choice(5, 8000, p=biased), minlength=5), probs)
    with pytest.raises(AssertionError, match="zero target probability: \\[\\(1, 2\\)\\]"):
        assert_follows({(0, 1): 5, (1, 2): 1}, {(0, 1): 1.0})


@pytest.mark.parametrize("kind", ["stochastic", "deterministic", "mixed"])
def test_sampling_verification_preserves_the_target_distribution(kind: str) -> None:
    """Speculative sampling over a 2-level tree emits pairs distributed exactly as the target's."""
    vocab = 5
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    target_logits = rng.normal(size=(vocab + 1, vocab)) * 1.5    # row 0: after root; row 1+t: after t
    draft_logits = target_logits + rng.normal(size=target_logits.shape)
    p_first = distribution(target_logits[0], params)
    n = 8000
    counts = np.zeros((vocab, vocab))
    for _ in range(n):
        tree = TokenTree.rooted_at(0)
        q1 = distribution(draft_logits[0], params)
        if kind in ("stochastic", "mixed"):
            t1 = sample(q1, rng)
            a = tree.add(0, t1, draft_probs=q1)
            q2 = distribution(draft_logits[1 + t1], params)
            tree.add(a, sample(q2, rng), draft_probs=q2)
        if kind in ("deterministic", "mixed"):
            tree.add_path(0, [int(np.argmax(q1)), 2])
            tree.add_path(0, [3, 1])
        rows = np.stack([target_logits[0] if i == 0 else target_logits[1 + tree.tokens[i]]
                         for i in range(len(tree))])
        path, bonus, _ = verify_sampling(tree, rows, params, rng)
        emitted = [tree.tokens[i] for i in path[1:]] + [bonus]
        if len(emitted) == 1:
            # only one token came out of this pass: draw the second from the target itself
            second = sample(distribution(target_logits[1 + emitted[0]], params), rng)
            emitted.append(second)
        counts[emitted[0], emitted[1]] += 1
    joint = np.array([[p_first[a] * distribution(target_logits[1 + a], params)[b] for b in range(vocab)]
                      for a in range(vocab)])
    assert_follows(counts, joint, what=kind)


@pytest.mark.parametrize("drafts", ["one q twice", "one q three times", "two qs"])
def test_sampled_siblings_preserve_the_target_distribution(drafts: str) -> None:
    """Several sampled children of one node (multi-draft, as SpecInfer): each sibling is tried against the
    renormalised residual the earlier rejections left. Trying each against the original p, or against
    an unnormalised residual, moves the first token by a total variation of about 0.1."""
    vocab = 6
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.95, min_p=0.0)
    target_logits = rng.normal(size=vocab) * 1.5
    qs = [distribution(target_logits + rng.normal(size=vocab) * 1.5, params) for _ in range(2)]
    draws = {"one q twice": [qs[0]] * 2, "one q three times": [qs[0]] * 3, "two qs": qs}[drafts]
    rows = np.stack([target_logits] * (1 + len(draws)))
    n = 20000
    counts = np.zeros(vocab)
    for _ in range(n):
        tree = TokenTree.rooted_at(0)
        for q in draws:
            tree.add(0, sample(q, rng), draft_probs=q)
        path, bonus, _ = verify_sampling(tree, rows, params, rng)
        counts[tree.tokens[path[1]] if len(path) > 1 else bonus] += 1
    assert_follows(counts, distribution(target_logits, params), what=drafts)
