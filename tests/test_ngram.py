import numpy as np

from adaspark.scheduler.ngram import NgramIndex, exploration_swap
from adaspark.scheduler.tree import (
    COPY,
    FOLLOWER,
    NGRAM,
    Block,
    CandidateTree,
    bucket_of,
    evidence_of,
    layout,
    rank,
)


def tree_for(rows, anchor, head=0.5, stop_ids=()):
    ids = np.array(rows)
    B, K = ids.shape
    logits = np.tile(-np.arange(K, dtype=float), (B, 1))
    return CandidateTree.from_block(Block(ids[:, 0], ids, logits, np.full(B, head)), anchor,
                                    stop_ids)


def ngram_tokens(tree):
    return tree.token[tree.kind == NGRAM].tolist()


PASSAGE = list(range(100, 140))  # 40 distinct tokens


def test_copy_chain_reads_on_along_the_earlier_passage_and_contradicts():
    index = NgramIndex(PASSAGE + [1, 2, 3] + PASSAGE[:10])  # ends ... 108 109 (match of 10)
    tree = tree_for([[110, 5, 6], [111, 7, 8], [50, 51, 52]], anchor=109)
    index.chains(tree)
    # anchor -> 110 agrees with pick 0, chain from pick 0 -> 111 agrees with pick 1, chain from
    # pick 1 proposes 112 != 50: an n-gram branch reads on to depth 32.
    weak, strong = evidence_of(COPY, False), evidence_of(COPY, True)
    assert tree.agreed_bucket[0] == bucket_of(COPY, False, 0)
    assert tree.agreed_bucket[3] == bucket_of(COPY, False, 0)
    # every candidate other than the proposal is contradicted, the agreed picks are not
    assert tree.contra_evidence[:9].tolist() == [-1, weak, weak, -1, weak, weak] + [weak] * 3
    ng = np.flatnonzero(tree.kind == NGRAM)
    assert tree.token[ng].tolist() == list(range(112, 140)) + [1, 2]
    assert tree.parent[ng[0]] == 3 and tree.depth[ng[-1]] == 32
    assert np.array_equal(tree.parent[ng[1:]], ng[:-1])
    # match length grows as the chain reads on: 12 at the first node, >= 16 from the fifth
    assert tree.bucket[ng[0]] == bucket_of(COPY, False, 0)
    assert tree.bucket[ng[1]] == bucket_of(COPY, False, 1)
    assert tree.bucket[ng[4]] == bucket_of(COPY, True, 4)
    p = index.precision
    assert tree.logit_p[ng[4]] == np.log(p[strong] / (1 - p[strong]))


def test_longest_match_wins_and_latest_wins_ties():
    # 7 8 9 10 occurs three times: after "1 7 8 9 10" (then 20), "2 7 8 9 10" (then 30) and
    # "5 6 7 8 9 10" (then 40); the context ends "5 6 7 8 9 10", so the third is longest.
    index = NgramIndex([5, 6, 7, 8, 9, 10, 40, 1, 7, 8, 9, 10, 20, 2, 7, 8, 9, 10, 30,
                        5, 6, 7, 8, 9, 10])
    tree = tree_for([[60, 61]], anchor=10)
    index.chains(tree)
    assert ngram_tokens(tree)[0] == 40
    # equal matches (4 tokens each): the latest occurrence wins
    index = NgramIndex([1, 7, 8, 9, 10, 20, 2, 7, 8, 9, 10, 30, 3, 7, 8, 9, 10])
    tree = tree_for([[60, 61]], anchor=10)
    index.chains(tree)
    assert ngram_tokens(tree)[0] == 30


def test_follower_chain_uses_the_most_frequent_follower():
    text = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3, 8, 4, 4, 1, 2, 3]
    index = NgramIndex(text)
    tree = tree_for([[70, 71]], anchor=3)
    index.chains(tree)
    # 1 2 3 is followed by 9 once and 8 twice; no 4-token key "x 1 2 3" continues uniquely
    # longer, but "4 1 2 3" never occurred, so the copy index has nothing and followers answer.
    ng = np.flatnonzero(tree.kind == NGRAM)
    assert tree.token[ng[0]] == 8
    assert tree.bucket[ng[0]] == bucket_of(FOLLOWER, True, 0)
    assert tree.contra_evidence[:2].tolist() == [evidence_of(FOLLOWER, True)] * 2


def test_follower_table_keeps_four_followers():
    text = []
    for follower in (11, 12, 13, 14, 15):
        text += [1, 2, 3, follower, 0, 0]
    text += [1, 2, 3, 15, 0, 0, 1, 2, 3]
    index = NgramIndex(text)
    table = index._followers[(1, 2, 3)]
    assert len(table) == 4 and 15 in table and table[15][0] == 2


def test_agreed_sibling_continues_below_and_stop_token_ends_the_chain():
    index = NgramIndex([5, 6, 7, 8, 20, 21, 99, 22, 0, 5, 6, 7, 8])
    tree = tree_for([[30, 20, 31], [40, 41, 42]], anchor=8, stop_ids=[99])
    index.chains(tree)
    assert tree.agreed_bucket[1] == bucket_of(COPY, False, 0)  # sibling 20 agreed
    weak = evidence_of(COPY, False)
    assert tree.contra_evidence[:6].tolist() == [weak, -1, weak, -1, -1, -1]  # none at pos 1
    ng = np.flatnonzero(tree.kind == NGRAM)
    assert tree.token[ng].tolist()[:2] == [21, 99]
    assert tree.parent[ng[0]] == 1 and tree.parent[ng[1]] == ng[0]
    assert 22 not in tree.token[ng].tolist()  # nothing below the stop token


def test_chains_do_not_learn_and_precision_counts_committed_text():
    index = NgramIndex([1, 2, 3, 4, 5, 1, 2, 3, 4])
    # the 9th token (4) was predicted by nothing (follower table needs a 3-token context seen
    # before; "1 2 3" was followed by 4 once): follower count 1 -> matched 1, right 1
    ev = evidence_of(FOLLOWER, False)
    assert index.matched.tolist() == [0, 0, 0, 1] and index.right[ev] == 1
    before = (list(index.hist), index.matched.copy(), index.right.copy())
    index.chains(tree_for([[9, 8]], anchor=4))
    assert index.hist == before[0]
    assert np.array_equal(index.matched, before[1]) and np.array_equal(index.right, before[2])
    index.extend([5, 7])  # copy of "1 2 3 4" (length 4) predicts 5: right; then predicts 1: wrong
    weak_copy = evidence_of(COPY, False)
    assert index.matched[weak_copy] == 2 and index.right[weak_copy] == 1
    assert index.precision[weak_copy] == 2 / 4


def test_chain_depth_limit_and_handover_along_agreed_picks():
    text = list(range(200, 260))
    index = NgramIndex(text + [0] + text[:20])
    picks = [[220 + i, 1000 + i] for i in range(7)]  # every pick agrees with the copy
    tree = tree_for(picks, anchor=219)
    index.chains(tree)
    assert all(tree.agreed_bucket[2 * i] >= 0 for i in range(7))
    ng = np.flatnonzero(tree.kind == NGRAM)
    assert tree.parent[ng[0]] == 12 and tree.token[ng[0]] == 227  # from the last pick
    assert tree.depth.max() == 32 and ng.size == 32 - 7


def test_exploration_due_every_16th_tree_round_with_ngram_nodes():
    index = NgramIndex(PASSAGE + PASSAGE[:10])
    plain = tree_for([[1, 2]], anchor=5)
    plain.seal()
    assert not index.exploration_due(plain)
    with_ngram = tree_for([[1, 2]], anchor=109)
    index.chains(with_ngram)
    due = [index.exploration_due(with_ngram) for _ in range(32)]
    assert [k for k, d in enumerate(due) if d] == [15, 31]


def test_exploration_swap_takes_the_least_labelled_frontier_node():
    tree = tree_for([[10, 11], [12, 13]], anchor=1)
    a = tree.add_ngram(-1, 50, bucket=0, logit_p=1.0)
    tree.add_ngram(a, 51, bucket=1, logit_p=1.0)
    tree.add_ngram(0, 52, bucket=6, logit_p=1.0)
    tree.add_ngram(0, 53, bucket=6, logit_p=1.0)  # same bucket, lower Q below
    tree.seal()
    q = np.array([0.9, 0.05, 0.8, 0.1, 0.6, 0.5, 0.3, 0.2])
    r = rank(tree, q)
    kept = r.order[:4]  # nodes 0 (0.9), 2 (0.72), 4 (0.6), 5 (0.3)
    labels = np.zeros(12, dtype=np.int64)
    labels[[0, 1]] = 5
    swapped = exploration_swap(tree, kept, r.Q, labels)
    # base = {0, 2, 4}; frontier n-gram nodes: 5 (bucket 1), 6 and 7 (bucket 6, 0 labels)
    assert swapped[:3].tolist() == kept[:3].tolist() and swapped[3] == 6
    layout(tree, swapped)  # still a tree
    labels[6] = 9
    assert exploration_swap(tree, kept, r.Q, labels)[3] == 5


def test_no_chains_below_a_stop_pick():
    # "108 109 110 99" was once followed by 555: a chain from the stop pick would propose it
    index = NgramIndex(PASSAGE + [1, 108, 109, 110, 99, 555, 556, 2] + PASSAGE[:10])
    tree = tree_for([[110, 5], [99, 7], [112, 8]], anchor=109, stop_ids=[99])
    index.chains(tree)
    # anchor -> 110 agrees with pick 0; pick 0's chain proposes 111, contradicting 99 and 7;
    # the pick 99 is a stop token, so no chain starts from it or from the pick below it.
    ng = np.flatnonzero(tree.kind == NGRAM)
    assert ng.size > 0 and set(tree.parent[ng[:1]].tolist()) == {0}
    assert not np.any(np.isin(tree.parent[ng], [2, 4]))


def test_chain_priors_follow_the_precision_as_it_changes():
    # chains() keeps the precision's logit until extend() counts a proposal: every round's
    # n-gram nodes must carry the precision of the text committed so far.
    index = NgramIndex(PASSAGE + PASSAGE[:10])
    for step in range(6):
        tree = CandidateTree.undrafted(index.hist[-1])
        index.chains(tree)
        p = index.precision
        want = np.log(p / (1.0 - p))
        ng = np.flatnonzero(tree.kind == NGRAM)
        assert ng.size and np.array_equal(tree.logit_p[ng], want[tree.bucket[ng] // 3])
        before = p.copy()
        index.extend([PASSAGE[10 + step]])  # the proposal was right: its precision rises
        assert not np.array_equal(index.precision, before)


def test_proposes_says_whether_chains_would_grow_an_undrafted_tree():
    """Scheduler._ngram_tree skips chains() where proposes() is False: on texts with copies,
    followers and neither, after every token, the two agree."""
    rng = np.random.default_rng(3)
    texts = [PASSAGE[:20] + PASSAGE[:12], list(rng.integers(0, 6, 80)),
             list(rng.integers(0, 10_000, 60)), []]
    seen = set()
    for text in texts:
        index = NgramIndex()
        for i in range(len(text) + 1):
            if i:
                index.extend(text[i - 1:i])
            tree = CandidateTree.undrafted(text[i - 1] if i else 0)
            index.chains(tree)
            assert index.proposes() == (tree.n_nodes > 0)
            seen.add(index.proposes())
    assert seen == {True, False}
