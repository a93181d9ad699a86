"""A step's sampled token trees verified together: every unseeded sampled request's tree by
rejection_sampler.accept_tree_sampled's rule (recursive rejection sampling: at a node its children tried in draw
order against the residual each rejected sibling leaves, an accepted child descended into, the residual drawn from
where all are rejected), level by level for all trees at once on the device, with no host read: each level's token
and whether the tree was still going come back in the step's one read. The rule alone reads the host once a level
of every tree.

Each level draws fresh uniforms for every tree's children and a fresh race for its residual, whether a tree is
still going or has fewer children than the widest node (an unused independent draw changes no law): each output
follows the target alone, as the rule's does, with other numbers (the rule's draws depend on what it read).

In two halves around the step's one copy of host values (runtime/upload.py HostBatch): the trees' node tables
(each node's children, their tokens, its probabilities' row, its draft distribution's row) staged on the host; the
levels walked on the device once sent."""
from __future__ import annotations

import torch

from smartspec.runtime.sampler import draw_rows, uniforms
from smartspec.runtime.upload import HostBatch
from smartspec.types.tree import TokenTree


class StagedTrees:
    """The trees' node tables, staged in a HostBatch. starts: each tree's root row among the probabilities it is
    verified against (its node i's row follows at start + 1 + i). Nodes are numbered across the trees, each tree's
    root first (`roots`)."""

    def __init__(self, trees: list[TokenTree], starts: list[int], batch: HostBatch) -> None:
        self.trees = trees
        depths = [t.depths() for t in trees]
        self.levels = 1 + max(max(d, default=0) for d in depths)  # the last: a leaf's residual, drawn
        # the most children a node has at each level (the root's: 0): how many trials the level makes
        self.widths = [0] * self.levels
        for tree, depth in zip(trees, depths):
            for node in range(-1, len(tree)):
                level = 0 if node < 0 else depth[node]
                self.widths[level] = max(self.widths[level], len(tree.children(node)))
        self.width = max(1, max(self.widths))
        tokens, at, kids, p_rows, q_rows, roots = [], [], [], [], [], []
        self.child_probs: list[torch.Tensor] = []
        for tree, start in zip(trees, starts):
            base = len(kids)  # this tree's root; node i is base + 1 + i
            roots.append(base)
            for node in range(-1, len(tree)):
                children = tree.children(node)
                pad = self.width - len(children)
                tokens += [tree.tokens[c] for c in children] + [0] * pad
                at += [base + 1 + c for c in children] + [base + 1 + node] * pad
                kids.append(len(children))
                p_rows.append(start + 1 + node)
                q = tree.child_probs.get(node)
                q_rows.append(-1 if q is None else len(self.child_probs))
                if q is not None:
                    self.child_probs.append(q)
        self.tokens, self.at, self.kids = batch.ints(tokens), batch.ints(at), batch.ints(kids)
        self.p_rows, self.q_rows, self.roots = batch.ints(p_rows), batch.ints(q_rows), batch.ints(roots)

    def verdicts(self, p: torch.Tensor, generators: list[torch.Generator | None],
                 sent: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """([levels, trees] the token each level gave, [levels, trees] whether the tree was still going there),
        on p's device; p: the probabilities the trees' rows are in (each tree's at its start)."""
        dev, w = p.device, self.width
        child_tokens, child_at = sent[self.tokens].view(-1, w), sent[self.at].view(-1, w)
        kids, p_rows, q_rows = sent[self.kids], sent[self.p_rows], sent[self.q_rows]
        q_all = torch.stack(self.child_probs) if self.child_probs else p.new_zeros(1, p.shape[-1])
        node = sent[self.roots]
        going = torch.ones(len(node), dtype=torch.bool, device=dev)
        tokens, goings = [], []
        for width in self.widths:
            goings.append(going)
            if not width:  # leaves only: the residual is the target's row, and every tree stops here
                tokens.append(draw_rows(p[p_rows[node]], generators))
                continue
            u = uniforms([width] * len(generators), generators, dev).view(-1, width)  # each tree's row its own
            took, child, residual = self._level(p[p_rows[node]], q_all, q_rows[node], child_tokens[node], kids[node], u)
            drawn = draw_rows(residual, generators)
            tokens.append(torch.where(took, child_tokens[node].gather(1, child[:, None])[:, 0], drawn))
            node = torch.where(took, child_at[node].gather(1, child[:, None])[:, 0], node)
            going = going & took
        return torch.stack(tokens), torch.stack(goings)

    def _level(self, residual: torch.Tensor, q_all: torch.Tensor, q_rows: torch.Tensor, tokens: torch.Tensor,
               kids: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One level of every tree: its node's children tried in draw order (the rule's trials, each tree's own
        numbers in its row; u [trees, the level's most children]). Returns whether a child was accepted, the first
        accepted (column), and the residual after all of them. Trees without draft distributions (prompt lookup's:
        fixed tokens) skip their operations."""
        has_q = (q_rows >= 0)[:, None] if self.child_probs else None
        q = torch.where(has_q, q_all[q_rows.clamp(min=0)], 0.0) if has_q is not None else None
        trials = []
        for j in range(u.shape[1]):
            tok, tries = tokens[:, j:j + 1], (kids > j)[:, None]
            r_tok = residual.gather(1, tok)
            # the rejected child's draft mass leaves the residual: its token's, or q's (renormalised without it)
            left = residual.scatter(1, tok, 0.0)
            if q is None:
                trials.append(tries & (u[:, j:j + 1] < r_tok))
            else:
                trials.append(tries & (u[:, j:j + 1] * torch.where(has_q, q.gather(1, tok), 1.0) < r_tok))
                left = torch.where(has_q, torch.clamp(residual - q, min=0.0), left)
                q_left = q.scatter(1, tok, 0.0)
                q_mass = q_left.sum(dim=-1, keepdim=True)
                q = torch.where(tries & has_q, torch.where(q_mass > 0, q_left / q_mass, q_left), q)
            mass = left.sum(dim=-1, keepdim=True)  # 0: r == q' up to rounding, the rejection had probability ~0
            residual = torch.where(tries & (mass > 0.0), left / mass, residual)
        trials = torch.cat(trials, dim=1)
        return trials.any(dim=1), trials.int().argmax(dim=1), residual

    def tokens_of(self, host: list[int], at: int, tree: int) -> list[int]:
        """Tree `tree`'s new tokens from the step's read, where this stage's answer (tokens, then going) sits at
        `at`: a level's token while the tree was still going there."""
        n = len(self.trees)
        going = at + self.levels * n
        return [host[at + level * n + tree] for level in range(self.levels) if host[going + level * n + tree]]
