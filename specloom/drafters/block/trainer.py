"""`specloom train dflash` / `dflash2` / `dspark`: block drafters (drafters.md §5.3, §5.4, §6.1).

Per batch, up to `--num-anchors` anchors per sequence are drawn from its answer positions (loss mask), none in the
last `block_size` positions. Each anchor gives a block [x_a, MASK ...] at positions a.. that sees the sequence's
target features before a (`BlockDraftModel.train_blocks`). Labels are the target's soft distributions: the target
head over the stored final hidden state at the position before each slot's predicted token. Loss: soft
cross-entropy per drafted slot k (1-based), weighted exp(-(k-1)/4). DSpark adds the Markov head (teacher-forced:
the previous token is the true one) and the confidence head, trained with BCE towards c* = 1 - 1/2 ||p_d - p_t||_1
(detached). DFlash 2 adds its convs (start as the identity) and the candidate selector, trained with a K-way
soft cross-entropy over each slot's top-K candidates (speculators #1006's objective: the target's probabilities
at the candidates; teacher-forced previous token), on top of the DFlash loss on the unrescored logits.
`--init-from DIR` starts DFlash 2 from a trained DFlash checkpoint of the same shape (every shared tensor copied;
the convs and the selector then start as DFlash itself). Metrics acc{j}: top-1 agreement with the target at
drafted slot j (0 = the first draft; DFlash 2: the selector's choice).

Feature ids: the EAGLE-3 ids of `specloom data` (HF 2, L//2, L-3, i.e. z-lab/DeepSpec 1, L//2-1, L-4).
Checkpoints: DFlash in the z-lab format; DSpark as a built-in overlay (`config.json` with the `dspark_*` keys and
the `mtp.*` tensors), which `method: dspark` finds without `model` once bundled for the target.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from ...training.common import _Base, _soft_ce
from ..base import trainer
from ...training.options import draft_layers_option, option, positive_int, warm_start_option
from ...training.distributed import shard_mean, total_rows

DECAY = 4.0  # slot weight exp(-(k-1)/DECAY), DeepSpec / speculators default


def default_mask_token(tokenizer, data, vocab_size: int) -> int:
    """A token the target never emits: the highest-id added (special) token that is not BOS/EOS/pad and never
    occurs in the training data; else the data's rarest token (highest id among ties)."""
    hf = tokenizer.hf
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for t, _, _ in data.seqs:
        counts += torch.bincount(t, minlength=vocab_size)[:vocab_size]
    reserved = {hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, *tokenizer.eos_token_ids}
    added = sorted(getattr(hf, "added_tokens_decoder", {}) or {}, reverse=True)
    for i in added:
        if i not in reserved and i < vocab_size and counts[i] == 0:
            return int(i)
    order = torch.argsort(counts.flip(0), stable=True)  # rarest first, highest id first among ties
    return int(counts.numel() - 1 - order[0])


def dpace_weights(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """D-PACE slot weights (ModelOpt / speculators' DFlash default): w_j = sum_{m >= j} prod_{i <= m} a_i, a_i the
    acceptance chance of slot i now (sum_v min(p, q), detached), normalised to mean 1 per anchor: a slot counts
    as much as the accepted tokens it can still lead to. logits, tgt (N, S, V) -> (N, S)."""
    a = torch.minimum(torch.softmax(logits.float(), -1), torch.softmax(tgt.float(), -1)).sum(-1)  # (N, S)
    reach = torch.cumprod(a, -1)
    w = reach.flip(-1).cumsum(-1).flip(-1)
    return w / w.mean(-1, keepdim=True).clamp(min=1e-6)


def warm_start(model, target, layer: int) -> None:
    """Start the draft layers from target layers `layer`, `layer` + 1, ... (negative: from the end): attention,
    MLP and norms copied (training/warm_start.py), `fc` picking the last feature and `hidden_norm` the first copied
    layer's input norm, so the context keys/values start as that layer's own over the last feature. The q/k norms
    a target lacks stay at one."""
    from ...training.warm_start import copy_layer, pick_last_feature, start_layer

    first = start_layer(target, layer, len(model.layers))
    for i, dst in enumerate(model.layers):
        copy_layer(dst, target.layers[first + i], dst.input_layernorm)
    with torch.no_grad():
        model.hidden_norm.weight.copy_(target.layers[first].input_layernorm.weight.float())
    pick_last_feature(model.fc, model.config.target_hidden_size)


class _BlockTrainer(_Base):
    anchor_predicts = False
    default_block = 6
    markov = False

    def extra_config(self, args, tc) -> dict:
        """Further BlockDraftConfig fields of this kind (DFlash 2: convs and selector)."""
        return {}

    @classmethod
    def data_ids(cls, L):
        from ..eagle.model import eagle3_layer_ids

        return tuple(sorted({*eagle3_layer_ids(L), L}))

    def __init__(self, target, tokenizer, data, args):
        super().__init__(target, tokenizer, data, args)
        from .model import BlockDraftConfig, BlockDraftModel
        from ..eagle.model import init_weights
        from ..eagle.model import eagle3_layer_ids

        tc = target.config
        self.feature_ids = tuple(sorted(set(eagle3_layer_ids(self.L))))
        mask = args.mask_token_id if args.mask_token_id is not None else default_mask_token(tokenizer, data, tc.vocab_size)
        rank = args.markov_rank if self.markov else 0
        cfg = BlockDraftConfig(
            hidden_size=tc.hidden_size, num_layers=args.draft_layers or 1, num_heads=tc.num_heads,
            num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim,
            intermediate_size=args.draft_intermediate or max(1, tc.intermediate_size // 2),
            vocab_size=tc.vocab_size, block_size=args.block_size or self.default_block, mask_token_id=mask,
            feature_ids=self.feature_ids, target_hidden_size=tc.hidden_size, rms_norm_eps=tc.rms_norm_eps,
            rope_theta=tc.rope_theta, rope_scaling=tc.rope_scaling, anchor_predicts=self.anchor_predicts,
            markov_rank=rank, markov_head_type=args.markov_head, confidence_head=self.markov,
            max_position=tc.max_position, **self.extra_config(args, tc),
        )
        self.model = BlockDraftModel(cfg)
        init_weights(self.model, args.seed)
        self.model.reset_extras()  # the convs as the identity, the selector's pair score zero (init_weights drew them)
        layer = getattr(args, "warm_start_layer", None)
        if layer is not None:
            warm_start(self.model, target, layer)
        with torch.no_grad():
            self.model.norm.weight.copy_(target.norm.weight.float())  # the head expects the target's final scale
            if rank:
                self.model.markov_head.markov_w2.weight.zero_()  # start as the plain backbone
        self.model.attach_target(target)
        print(f"specloom train {self.kind}: block {cfg.block_size} ({cfg.num_drafts} drafts), {cfg.num_layers} "
              f"layer(s), mask token {mask}, target layers (HF ids) {list(self.feature_ids)}", file=sys.stderr)

    def _anchors(self, loss_mask, valid):
        """(B, A) anchor positions and (B, A) validity: up to --num-anchors answer positions per sequence, each
        with at least one context position before it and a whole labelled block after it."""
        bs = self.model.config.block_size
        B, T = valid.shape
        n = valid.sum(1, keepdim=True)
        dev = valid.device
        pos = torch.arange(T, device=dev)[None]
        ok = loss_mask & valid & (pos >= 1) & (pos <= n - 1 - bs)
        A = self.args.num_anchors
        picks = []
        for b in range(B):
            idx = ok[b].nonzero().flatten()
            if idx.numel() > A:
                idx = idx[torch.randperm(idx.numel(), generator=self.gen)[:A]].sort().values
            picks.append(idx)
        width = max(1, max(p.numel() for p in picks))
        anchors = torch.zeros(B, width, dtype=torch.long, device=dev)
        good = torch.zeros(B, width, dtype=torch.bool, device=dev)
        for b, p in enumerate(picks):
            anchors[b, :p.numel()] = p
            good[b, :p.numel()] = True
        return anchors, good

    def loss(self, batch):
        m = self.model
        c = m.config
        tokens, valid = batch["tokens"], batch["valid"]
        anchors, good = self._anchors(batch["loss_mask"], valid)
        n = total_rows(int(good.sum()))  # anchors over all processes' shares of the batch (training/distributed.py)
        if n == 0:
            return sum(p.sum() * 0.0 for p in self.parameters()), {}
        feats = torch.cat([batch["hidden"][i] for i in self.feature_ids], -1)
        h = m.train_blocks(feats, tokens, valid, anchors)  # (B, A, bs, H)
        s0, S = c.first_slot, c.num_drafts
        dev = tokens.device
        slots = torch.arange(S, device=dev)
        # target row whose next-token distribution labels each drafted slot = the position before its token
        rows = anchors[..., None] + slots  # (B, A, S); DFlash slot j+1 / DSpark slot j predict position row + 1
        bidx = torch.arange(tokens.shape[0], device=dev)[:, None].expand_as(anchors)[good]  # (N,)
        rows = rows[good]  # (N, S)
        hs = h[:, :, s0:s0 + S][good]  # (N, S, H)
        tgt = self.target_logits(batch["hidden"][self.L][bidx[:, None], rows])  # (N, S, V)
        logits = m.draft_logits(hs)
        prev = tokens[bidx[:, None], rows]  # the token before each slot's prediction (teacher forcing)
        if m.has_markov:
            state, bias = None, []
            for j in range(S):
                bj, state = m.markov_bias(prev[:, j], hs[:, j], state)
                bias.append(bj)
            logits = logits + torch.stack(bias, 1)
        if getattr(self.args, "slot_weights", "dpace") == "dpace":  # the accepted tokens each slot leads to
            w = dpace_weights(logits.detach(), tgt)  # (N, S)
        else:
            w = torch.tensor([math.exp(-j / DECAY) for j in range(S)], device=dev).expand(logits.shape[0], S)
        w = w / w.sum(-1, keepdim=True).clamp(min=1e-6)  # each anchor's slot weights sum to 1
        ce = _soft_ce(logits, tgt)  # (N, S)
        if getattr(self.args, "block_loss", "ce") == "dspark":  # DSpark's: 0.1 CE + 0.9 total variation
            tv = 0.5 * (torch.softmax(logits.float(), -1) - torch.softmax(tgt.float(), -1)).abs().sum(-1)
            ce = 0.1 * ce + 0.9 * tv
        total = (ce * w).sum() / n
        metrics = {}
        agree = logits.argmax(-1) == tgt.argmax(-1)
        if m.has_selector:  # K-way soft CE over the candidates: the target's mass there, renormalised by the softmax
            sc, cand = m.candidate_selector.scores(logits, hs, prev)  # (N, S, K)
            pt = torch.softmax(tgt.float(), -1).gather(-1, cand)
            sel = -(pt * torch.log_softmax(sc, -1)).sum(-1)  # = mass x CE against the target within the candidates
            total = total + (sel * w).sum() / n
            agree = cand.gather(-1, sc.argmax(-1, keepdim=True)).squeeze(-1) == tgt.argmax(-1)
            metrics["in_top_k"] = float(shard_mean((cand == tgt.argmax(-1, keepdim=True)).any(-1)[:, 0].float(), n))
        for j in range(S):
            metrics[f"acc{j}"] = float(shard_mean(agree[:, j].float(), n))
        # a greedy chain's accepted length: the block's slots hold (given the anchor) until the first miss, plus the
        # target's own token -- the held-out figure the losses are compared on
        metrics["tau"] = 1.0 + float(shard_mean(agree.long().cumprod(-1).sum(-1).float(), n))
        if m.has_confidence:
            with torch.no_grad():
                target_c = 1 - 0.5 * (torch.softmax(logits.float(), -1) - torch.softmax(tgt, -1)).abs().sum(-1)
            cl = m.confidence_logit(hs, prev)
            bce = F.binary_cross_entropy_with_logits(cl.float(), target_c.clamp(0, 1), reduction="none")
            total = total + (bce * w).sum() / n
            metrics["conf_err"] = float(shard_mean((torch.sigmoid(cl.float()) - target_c).abs(), n * S))
        return total, metrics

    def target_logits(self, h, rows=None):
        return self.target.logits(h.to(self.head_w.dtype))


@trainer("dflash")
class DFlashTrainer(_BlockTrainer):
    def save(self, path, meta):
        from ..checkpoint import save_drafter

        save_drafter("dflash", self.model, path, {**meta, "target": self.args.target}, fmt="zlab",
                     num_target_layers=self.L)


@trainer("dflash2")
class DFlash2Trainer(_BlockTrainer):
    def extra_config(self, args, tc) -> dict:
        return {"conv_kernel_size": args.conv_kernel_size, "conv_group_size": args.conv_group_size,
                "selector_rank": args.selector_rank, "selector_top_k": args.selector_top_k}

    def init_from(self, path: str) -> None:
        """`--init-from`: a DFlash 2 checkpoint (every tensor it shares), or a DFlash one (its tensors; the convs
        and the selector keep their neutral start)."""
        from .format import layout_of
        from ..checkpoint import _load_json, init_from_checkpoint

        if layout_of(_load_json(f"{path}/config.json")) == "dflash2":
            return init_from_checkpoint(self.model, path, "dflash2", self.target, self.tokenizer)
        init_from_dflash(self.model, path, self.target)

    def save(self, path, meta):
        from ..checkpoint import save_drafter

        save_drafter("dflash2", self.model, path, {**meta, "target": self.args.target}, fmt="zlab",
                     num_target_layers=self.L)


def init_from_dflash(model, path: str, target) -> None:
    """Copy a DFlash checkpoint's backbone into a DFlash 2 or DSpark model: `fc`, `hidden_norm`, the draft layers
    and `norm` (none of them depends on the block size, so a DSpark of block 5 may start from a DFlash of block
    6 -- the DSpark paper's warm start). The layers must match in number and width (one clear line otherwise);
    what the DFlash lacks (convs, selector, Markov and confidence heads) keeps its neutral start."""
    from ...errors import SpecloomError
    from .format import block_config, expected_shapes
    from ..checkpoint import _load_json, read_tensors, take, weights_file

    raw = _load_json(f"{path}/config.json")
    cfg = block_config(path, raw, target.config, "dflash")
    mine = model.config
    if (cfg.num_layers, cfg.intermediate_size, tuple(cfg.feature_ids)) != (
            mine.num_layers, mine.intermediate_size, tuple(mine.feature_ids)):
        raise SpecloomError(f"{path}: --init-from needs a DFlash drafter of the same shape ({cfg.num_layers} layers, "
                            f"MLP {cfg.intermediate_size}, features {list(cfg.feature_ids)}; this run: "
                            f"{mine.num_layers} layers, MLP {mine.intermediate_size}, features "
                            f"{list(mine.feature_ids)})")
    wf = weights_file(path)
    tensors = read_tensors(wf)
    own = model.state_dict()
    with torch.no_grad():
        for name, shape in expected_shapes(cfg).items():
            own[name].copy_(take(tensors, name, shape, wf).to(own[name].dtype))
    if mine.anchor_predicts == cfg.anchor_predicts:  # the same slot meaning: the same MASK token
        mine.mask_token_id = cfg.mask_token_id
    print(f"specloom train {'dspark' if mine.anchor_predicts else 'dflash2'}: started from the DFlash drafter {path}",
          file=sys.stderr)


@trainer("dspark")
class DSparkTrainer(_BlockTrainer):
    anchor_predicts = True
    default_block = 5
    markov = True

    def init_from(self, path: str) -> None:
        """`--init-from`: a DSpark checkpoint (every tensor it shares), or a DFlash one (its backbone; the
        Markov and confidence heads keep their neutral start)."""
        from .format import layout_of
        from ..checkpoint import _load_json, init_from_checkpoint

        if layout_of(_load_json(f"{path}/config.json")) in ("zlab", "speculators-dflash"):
            return init_from_dflash(self.model, path, self.target)
        init_from_checkpoint(self.model, path, "dspark", self.target, self.tokenizer)

    def save(self, path, meta):
        from ..checkpoint import save_drafter

        save_drafter("dspark", self.model, path, {**meta, "target": self.args.target}, fmt="overlay")


def add_arguments(t) -> None:
    """`specloom train dflash | dspark` options."""
    draft_layers_option(t)
    option(t, "--block-size", type=positive_int, default=None,
           help="dflash, dflash2, dspark: tokens per block (default: dflash/dflash2 6 = 5 drafts, dspark 5 = 5 "
                "drafts)")
    option(t, "--num-anchors", type=positive_int, default=32,
           help="dflash, dspark: blocks (anchors) trained per sequence and batch")
    option(t, "--markov-rank", type=int, default=32, help="dspark: Markov head rank (0 = none)")
    option(t, "--slot-weights", choices=("decay", "dpace"), default="dpace",
           help="dflash, dflash2, dspark: per-slot loss weights: D-PACE (default: the expected accepted tokens each "
                "slot leads to, from the drafter's current acceptance; won on the held-out split, BENCHMARKS.md) or "
                "exp(-(k-1)/4)")
    option(t, "--block-loss", choices=("ce", "dspark"), default="ce",
           help="dflash, dflash2, dspark: soft cross-entropy (default) or DSpark's 0.1 CE + 0.9 total variation")
    option(t, "--conv-kernel-size", type=positive_int, default=2, help="dflash2: taps of the dynamic causal conv")
    option(t, "--conv-group-size", type=positive_int, default=64,
           help="dflash2: channels sharing one dynamic tap weight (must divide the hidden size)")
    option(t, "--selector-rank", type=positive_int, default=16, help="dflash2: rank of the candidate selector")
    option(t, "--selector-top-k", type=positive_int, default=16, help="dflash2: candidates per slot")

    option(t, "--markov-head", choices=("vanilla", "gated", "rnn"), default="vanilla", help="dspark: Markov head type")
    option(t, "--draft-intermediate", type=positive_int, default=None,
           help="dflash, dspark: MLP width of the draft layers (default: half the target's)")
    option(t, "--mask-token-id", type=int, default=None,
           help="dflash, dspark: the MASK token of the block (default: the highest-id special token that is not "
                "BOS/EOS/pad and never occurs in the data, e.g. SmolLM2's <empty_output>)")
    warm_start_option(t)
