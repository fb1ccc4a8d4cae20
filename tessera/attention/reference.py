"""A plain per-request float32 loop: slow and easy to trust; tests hold the fast backends to it."""
from __future__ import annotations

import torch

from tessera.attention.base import (AttentionBackend, add_key_bias, check_sinks, is_quantized, read_blocks,
                                    rotate_for_cache, write_kv)


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window, key_bias=None, softcap=None, sinks=None):
        sinks = check_sinks(sinks, q.shape[1], softcap, q.device)
        key_bias = key_bias if is_quantized(kv_cache) else None
        q, k = rotate_for_cache(kv_cache, q, k, meta, key_bias)
        write_kv(kv_cache, k, v, meta)
        bs = meta.block_size
        out = torch.empty_like(q)
        hq, hkv, d = q.shape[1], kv_cache.shape[1], q.shape[2]
        for i in range(meta.num_reqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            seq_len = meta.seq_lens[i]
            nblk = (seq_len + bs - 1) // bs
            blocks = meta.block_tables[i, :nblk]
            kv = read_blocks(kv_cache, blocks, bs, torch.float32).reshape(2, hkv, -1, d)[:, :, :seq_len]
            keys = add_key_bias(kv[0].unsqueeze(1), key_bias).squeeze(1).transpose(0, 1)
            vals = kv[1].transpose(0, 1)
            keys = keys.repeat_interleave(hq // hkv, dim=1)
            vals = vals.repeat_interleave(hq // hkv, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            qpos = torch.arange(seq_len - (end - start), seq_len).unsqueeze(1)
            kpos = torch.arange(seq_len).unsqueeze(0)
            allowed = kpos <= qpos
            if sliding_window is not None:
                allowed &= kpos > qpos - sliding_window
            scores = scores.masked_fill(~allowed, float("-inf"))
            if sinks is not None:  # transformers' gpt-oss eager attention: the sink as one more column
                column = sinks.view(hq, 1, 1).expand(hq, end - start, 1)
                probs = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
            else:
                probs = scores.softmax(dim=-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, vals).to(q.dtype)
        return out.view(q.shape[0], hq * d)
