"""N-gram candidates from the request's own committed text (§3.3).

API (stable; numpy only):

    index = NgramIndex(tokens=())          one per request; tokens = the prompt (committed text)
    index.extend(tokens)                   append committed tokens (accepted path + bonus). Each
                                           token is first predicted from the text before it, to
                                           count the source's precision, then learned.
    index.chains(tree) -> None             adds n-gram nodes to a CandidateTree and marks its
                                           agreed / contradicted drafter nodes, then tree.seal().
                                           The anchor is taken to be the last committed token.
    index.precision -> float64[4]          p = (right + 1) / (matched + 2) per evidence kind
                                           (tree.evidence_of: copy>=16, copy 4-15, follower>=2, 1)
    index.exploration_due(tree) -> bool    True on every 16th call with a tree that has n-gram
                                           nodes (call once per tree round)
    exploration_swap(tree, kept, Q, bucket_labels) -> kept'
        kept' = kept with its last node replaced by the unplaced n-gram frontier node (parent
        placed) of the bucket with the fewest labels (highest Q within it); kept unchanged when
        there is none. Lay kept' out with tree.layout.

Sources: the copy index maps each 4-token key to the last 8 positions it ended at; a lookup
takes the longest match of the context's suffix (4..64 tokens, the latest occurrence on ties)
and a chain reads on along that earlier passage (overlapping the context itself, as LZ77 does,
so a periodic text keeps repeating). Without a copy match the follower table (last 3 tokens ->
up to 4 followers with counts) proposes its most frequent follower.

Chains start from the anchor, then from each pick (context = committed text + the picks above).
A step equal to a drafter candidate of the current parent marks it agreed; at an agreed pick the
chain stops (the chain from that pick carries on), below an agreed sibling it continues. Any
other step is a new n-gram node. Every drafter candidate of that parent other than the proposed
token is marked contradicted (its parent has a different n-gram proposal).
Chains stop 32 tokens below the anchor, after a stop token, or when nothing is proposed.
"""

from __future__ import annotations

import numpy as np

from adaspark.scheduler.tree import (
    COPY,
    FOLLOWER,
    N_EVIDENCE,
    NGRAM,
    CandidateTree,
    bucket_of,
    evidence_of,
)

KEY_LEN = 4
MAX_MATCH = 64
STRONG_COPY = 16
OCCURRENCES = 8
FOLLOWER_CTX = 3
MAX_FOLLOWERS = 4
MAX_DEPTH = 32
EXPLORE_PERIOD = 16


class NgramIndex:
    """Copy index + follower table over one request's committed text."""

    def __init__(self, tokens=()):
        self.hist: list[int] = []
        self._keys: dict[tuple, list[int]] = {}
        self._followers: dict[tuple, dict[int, list[int]]] = {}
        self.right = np.zeros(N_EVIDENCE)
        self.matched = np.zeros(N_EVIDENCE)
        self._copy: tuple[int, int] | None = None  # stream's passage: (end position, length)
        self._tree_rounds = 0
        self._logit_p: list[float] | None = None  # logit of precision, until it changes
        self.extend(tokens)

    # --- learning from committed text ---------------------------------------------------

    @property
    def precision(self) -> np.ndarray:
        return (self.right + 1.0) / (self.matched + 2.0)

    def extend(self, tokens) -> None:
        hist = self.hist
        keys, followers = self._keys, self._followers
        for t in (int(x) for x in tokens):
            pred = self._propose(hist, [], self._copy)
            if pred is not None:
                tok, kind, strength, state = pred
                ev = evidence_of(kind, _strong(kind, strength))
                self.matched[ev] += 1.0
                hit = tok == t
                self.right[ev] += hit
                self._logit_p = None
                self._copy = state if hit else None
            hist.append(t)
            i = len(hist) - 1
            if i >= FOLLOWER_CTX:
                ctx3 = tuple(hist[i - FOLLOWER_CTX:i])
                table = followers.get(ctx3)
                if table is None:
                    followers[ctx3] = {t: [1, i]}
                elif t in table:
                    entry = table[t]
                    entry[0] += 1
                    entry[1] = i
                else:
                    if len(table) >= MAX_FOLLOWERS:
                        del table[min(table, key=lambda k: table[k])]
                    table[t] = [1, i]
            if i >= KEY_LEN - 1:
                key = tuple(hist[i - KEY_LEN + 1:i + 1])
                ends = keys.get(key)
                if ends is None:
                    keys[key] = [i]
                else:
                    ends.append(i)
                    if len(ends) > OCCURRENCES:
                        del ends[0]

    # --- proposing ----------------------------------------------------------------------

    def _propose(self, hist: list, path: list, copy: tuple[int, int] | None):
        """Next token for context hist + path: (token, kind, match length or count, next copy
        state), or None. `copy` continues a passage being read on."""
        H = len(hist)
        n_ctx = H + len(path)
        if copy is not None:
            e, length = copy
            src = e + 1
            tok = hist[src] if src < H else path[src - H]
            return tok, COPY, length, (src, min(length + 1, MAX_MATCH))
        if n_ctx < FOLLOWER_CTX:
            return None
        # Most lookups miss: the context's last 64 tokens are joined only for a key that hits.
        if n_ctx >= KEY_LEN:
            ends = self._keys.get(_suffix(hist, path, KEY_LEN))
            if ends is not None:
                tail = hist[-MAX_MATCH:] + path if len(path) < MAX_MATCH else path[-MAX_MATCH:]
                found = self._longest(tail[-MAX_MATCH:], ends, n_ctx)
                if found is not None:
                    e, length = found
                    src = e + 1
                    tok = hist[src] if src < H else path[src - H]
                    return tok, COPY, length, (src, min(length + 1, MAX_MATCH))
        table = self._followers.get(_suffix(hist, path, FOLLOWER_CTX))
        if not table:
            return None
        tok = max(table, key=lambda k: table[k])  # most frequent, then most recent
        return tok, FOLLOWER, table[tok][0], None

    def _longest(self, tail: list, ends: list, n_ctx: int) -> tuple[int, int] | None:
        """Longest match of tail's suffix ending at one of `ends`; latest wins ties."""
        hist = self.hist
        T = len(tail)
        best_e, best_len = -1, 0
        for e in reversed(ends):
            if e + 1 >= n_ctx:
                continue  # the context's own suffix: nothing follows it yet
            top = min(T, e + 1, MAX_MATCH)
            if top <= best_len:
                continue
            if hist[e - top + 1:e + 1] == tail[T - top:]:
                length = top
            else:  # largest matching length in [KEY_LEN, top): matches are nested, so bisect
                lo, hi = KEY_LEN, top - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if hist[e - mid + 1:e + 1] == tail[T - mid:]:
                        lo = mid
                    else:
                        hi = mid - 1
                length = lo
            if length > best_len:
                best_e, best_len = e, length
        return None if best_len == 0 else (best_e, best_len)

    # --- chains -------------------------------------------------------------------------

    def proposes(self) -> bool:
        """Whether the index proposes a token at the anchor (what an undrafted tree's chain
        starts from): without one, chains() on an undrafted tree adds nothing."""
        return bool(self.hist) and self._propose(self.hist, [], self._copy) is not None

    def chains(self, tree: CandidateTree) -> None:
        """Add the round's n-gram chains to `tree` (see module docstring)."""
        if not self.hist:
            tree.seal()
            return
        if self._logit_p is None:  # the precision changes only where extend() counted
            self._logit_p = np.log(self.precision / (1.0 - self.precision)).tolist()
        logit_p = self._logit_p
        stops = tree.stop_set
        B, K = tree.B, tree.K
        rows = tree.token[:B * K].reshape(B, K).tolist()
        picks = [row[0] for row in rows]
        state = self._copy
        for start in range(-1, B):
            if start >= 0 and picks[start] in stops:
                break  # nothing below a stop token is worth a row
            parent = -1 if start < 0 else start * K
            state = self._chain(tree, parent, start, picks[:start + 1], state, rows, stops,
                                logit_p)
        tree.seal()

    def _chain(self, tree, parent, position, path, copy, rows, stops, logit_p):
        """One chain from the anchor (position -1) or pick `position`. Returns the copy state to
        hand to the next pick's chain when this one stopped at an agreed pick, else None."""
        hist = self.hist
        K = tree.K
        depth = position + 1
        spine = True  # parent is the anchor or a pick, so it has drafter candidates
        run = 0  # n-gram nodes directly above the next node
        path = list(path)
        while depth < MAX_DEPTH:
            pred = self._propose(hist, path, copy)
            if pred is None:
                return None
            tok, kind, strength, copy = pred
            strong = _strong(kind, strength)
            ev = evidence_of(kind, strong)
            if spine and position + 1 < len(rows):
                row = rows[position + 1]
                first = (position + 1) * K
                # Every candidate of this parent the proposal differs from is contradicted.
                tree.mark_contradicted(slice(first, first + K), ev, logit_p[ev])
                if tok in row:
                    k = row.index(tok)
                    tree.mark_agreed(first + k, bucket_of(kind, strong, 0), logit_p[ev])
                    if k == 0:
                        return copy  # the chain from this pick carries on
                    parent, spine, run = first + k, False, 0
                else:
                    parent = tree.add_ngram(parent, tok, bucket_of(kind, strong, 0), logit_p[ev])
                    spine, run = False, 1
            elif copy is not None and not spine:
                # Reading on along a passage below a non-drafter parent: the rest of the chain is
                # fixed, so add it in one go.
                self._read_on(tree, parent, path, tok, strength, copy, depth, run, stops, logit_p)
                return None
            else:
                parent = tree.add_ngram(parent, tok, bucket_of(kind, strong, run), logit_p[ev])
                spine, run = False, run + 1
            depth += 1
            path.append(tok)
            if tok in stops:
                return None
        return None

    def _read_on(self, tree, parent, path, tok, length, copy, depth, run, stops, logit_p):
        """Add `tok` and the rest of the passage it starts, to the depth limit, in one go."""
        hist = self.hist
        H = len(hist)
        need = MAX_DEPTH - depth - 1  # tokens after `tok`
        src = copy[0] + 1  # copy[0] is where `tok` came from
        if src + need <= H:
            rest = hist[src:src + need]
        else:  # the passage runs into the context's own end: it repeats with that period
            seg = (hist[src:] if src < H else []) + (path + [tok])[max(0, src - H):]
            rest = (seg * (need // len(seg) + 1))[:need]
        tokens = [tok] + rest
        if not stops.isdisjoint(tokens):
            tokens = tokens[:next(k for k, t in enumerate(tokens) if t in stops) + 1]
        k = np.arange(len(tokens))
        strong = length + k >= STRONG_COPY
        evidence = np.where(strong, evidence_of(COPY, True), evidence_of(COPY, False))
        above = run + k
        buckets = evidence * 3 + (above > 0) + (above > 2)  # tree.bucket_of, vectorised
        tree.add_ngram_chain(parent, tokens, buckets.tolist(),
                             np.asarray(logit_p)[evidence].tolist())

    # --- exploration --------------------------------------------------------------------

    def exploration_due(self, tree: CandidateTree) -> bool:
        if not tree.has_ngram:
            return False
        self._tree_rounds += 1
        return self._tree_rounds % EXPLORE_PERIOD == 0


def _suffix(hist: list, path: list, n: int) -> tuple:
    """The last n tokens of the context hist + path, as a key (all of it when shorter)."""
    short = n - len(path)
    return tuple(path[-n:]) if short <= 0 else tuple(hist[-short:] + path)


def _strong(kind: int, strength: int) -> bool:
    return strength >= STRONG_COPY if kind == COPY else strength >= 2


def exploration_swap(tree: CandidateTree, kept, Q, bucket_labels) -> np.ndarray:
    """Replace the last kept node by the least-labelled bucket's best unplaced frontier node."""
    kept = np.asarray(kept, dtype=np.int64).reshape(-1)
    if kept.size == 0 or not tree.has_ngram:
        return kept
    base = kept[:-1]
    N = tree.n_nodes
    placed = np.zeros(N + 1, dtype=bool)  # index node + 1; slot 0 is the anchor
    placed[0] = True
    placed[base + 1] = True
    Q = np.asarray(Q, dtype=np.float64)
    frontier = np.flatnonzero((tree.kind == NGRAM) & placed[tree.parent + 1]
                              & ~placed[1:] & (Q > 0.0))
    if frontier.size == 0:
        return kept
    labels = np.asarray(bucket_labels)[tree.bucket[frontier]]
    least = frontier[labels == labels.min()]
    # Fewest labels first, then the lowest bucket index, then highest Q, then the lowest node.
    buckets = tree.bucket[least]
    least = least[buckets == buckets.min()]
    node = least[np.argmax(Q[least])]
    return np.append(base, node)
