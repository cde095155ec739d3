#!/usr/bin/python3
"""An independent PyTorch (float64) implementation of DESIGN.md section 2, written from the text
of the design only (the dense and the mixture-of-experts FFN). It loads a Spindle checkpoint (safetensors, DESIGN.md tensor names) and
computes the mean cross-entropy of token sequences, so Spindle's loss can be checked against it.

    torch_reference.py CHECKPOINT_DIR TOKENS.bin SEQ_LEN N_SEQUENCES EOS_ID
prints one JSON line {"loss": ..., "tokens": ...}. TOKENS.bin: little-endian uint16 ids; sequence
n is tokens [n*SEQ_LEN, (n+1)*SEQ_LEN) of the file (wrapping around at its end)."""
import json, math, struct, sys

import torch


def load_safetensors(path):
    with open(path, 'rb') as f:
        raw = f.read()
    n = struct.unpack('<Q', raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == '__metadata__':
            continue
        assert t['dtype'] == 'F32', name
        b, e = t['data_offsets']
        vals = torch.frombuffer(bytearray(raw[base + b:base + e]), dtype=torch.float32)
        out[name] = vals.reshape(t['shape']).to(torch.float64)
    return out


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    # x [..., T, heads, d] with pos [T]: rotate-half pairs (j, j + d/2), angle pos * theta^(-2j/d)
    d = x.shape[-1]
    j = torch.arange(d // 2, dtype=torch.float64)
    ang = pos[:, None].to(torch.float64) * theta ** (-2.0 * j / d)
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def lightning(W, p, x, li, cfg, pos, starts):
    T, d = x.shape
    H = cfg['n_heads']
    Dh = d // H
    eps = cfg['norm_eps']
    qkv = x @ W[p + 'la.qkv.weight'].T
    q, k, v = qkv[:, :d].view(T, H, Dh), qkv[:, d:2 * d].view(T, H, Dh), qkv[:, 2 * d:].view(T, H, Dh)
    q = rope(rms(q, W[p + 'la.q_norm.weight'], eps), pos, cfg['rope_theta'])
    k = rope(rms(k, W[p + 'la.k_norm.weight'], eps), pos, cfg['rope_theta'])
    o = torch.zeros(T, H, Dh, dtype=torch.float64)
    for h in range(H):
        log_a = -2.0 ** (-8.0 * (h + 1) / H) * (1.0 - li / cfg['n_layers'] + 1e-5)
        a = math.exp(log_a)
        S = torch.zeros(Dh, Dh, dtype=torch.float64)
        for t in range(T):
            if starts[t]:
                S = torch.zeros(Dh, Dh, dtype=torch.float64)
            S = a * S + torch.outer(k[t, h], v[t, h])
            o[t, h] = (q[t, h] / math.sqrt(Dh)) @ S
    o = rms(o, W[p + 'la.out_norm.weight'].view(H, Dh), eps).reshape(T, d)
    o = o * torch.sigmoid(x @ W[p + 'la.gate.weight'].T)
    return o @ W[p + 'la.out.weight'].T


def mla(W, p, x, cfg, pos, doc):
    T, d = x.shape
    H = cfg['n_heads']
    m = cfg['mla']
    nope, rd, vd, kv = m['qk_nope_dim'], m['qk_rope_dim'], m['v_head_dim'], m['kv_lora_rank']
    eps = cfg['norm_eps']
    if m['q_lora_rank'] > 0:
        q = rms(x @ W[p + 'mla.q_a.weight'].T, W[p + 'mla.q_a_norm.weight'], eps) @ W[p + 'mla.q_b.weight'].T
    else:
        q = x @ W[p + 'mla.q.weight'].T
    q = q.view(T, H, nope + rd)
    q = torch.cat([q[..., :nope], rope(q[..., nope:], pos, cfg['rope_theta'])], -1)
    kva = x @ W[p + 'mla.kv_a.weight'].T
    c, kr = kva[:, :kv], kva[:, kv:]
    kvb = (rms(c, W[p + 'mla.kv_norm.weight'], eps) @ W[p + 'mla.kv_b.weight'].T).view(T, H, nope + vd)
    kr = rope(kr.view(T, 1, rd), pos, cfg['rope_theta']).expand(T, H, rd)
    k = torch.cat([kvb[..., :nope], kr], -1)
    v = kvb[..., nope:]
    scores = torch.einsum('thd,shd->hts', q, k) / math.sqrt(nope + rd)
    idx = torch.arange(T)
    allowed = (idx[None, :] <= idx[:, None]) & (doc[None, :] == doc[:, None])
    scores = scores.masked_fill(~allowed[None], float('-inf'))
    o = torch.einsum('hts,shd->thd', torch.softmax(scores, -1), v).reshape(T, H * vd)
    return o @ W[p + 'mla.out.weight'].T


def swiglu(h, w1, w3, w2):
    return (torch.nn.functional.silu(h @ w1.T) * (h @ w3.T)) @ w2.T


def moe_ffn(W, p, h, cfg):
    """DESIGN.md section 2's MoE FFN: sigmoid scores, the top-k of score + bias chosen, weights
    renormalised over the chosen, each expert a SwiGLU, plus the shared expert. Also returns the
    mean over tokens of logsumexp(z)^2, the router z-loss's term."""
    m = cfg['moe']
    z = h @ W[p + 'moe.router.weight'].T
    s = torch.sigmoid(z)
    chosen = torch.topk(s + W[p + 'moe.router.bias'], m['top_k'], dim=-1).indices
    g = torch.gather(s, -1, chosen)
    g = g / g.sum(-1, keepdim=True)
    w1, w2, w3 = (W[p + f'moe.experts.{n}.weight'] for n in ('w1', 'w2', 'w3'))
    y = torch.zeros_like(h)
    for e in range(m['experts']):
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        if len(rows):
            y = y.index_add(0, rows, g[rows, slot][:, None] * swiglu(h[rows], w1[e], w3[e], w2[e]))
    if m.get('shared_ffn', 0) > 0:
        y = y + swiglu(h, W[p + 'moe.shared.w1.weight'], W[p + 'moe.shared.w3.weight'],
                       W[p + 'moe.shared.w2.weight'])
    return y, (torch.logsumexp(z, -1) ** 2).mean()


def sequence_nll(W, cfg, tokens, eos, z_loss=0.0):
    """The summed negative log-likelihood of the sequence's valid targets (a float64 tensor that
    autograd can differentiate with respect to W) and their count. z_loss > 0 adds the LM head's
    z-loss, z_loss * logsumexp(logits)^2 summed over the same tokens (train.z_loss)."""
    T = len(tokens)
    ids = torch.tensor(tokens)
    starts, pos, doc, targets = [], [], [], []
    d_id, p_id = 0, 0
    for i, t in enumerate(tokens):
        start = i == 0 or tokens[i - 1] == eos
        if start and i > 0:
            d_id, p_id = d_id + 1, 0
        starts.append(start)
        pos.append(p_id)
        doc.append(d_id)
        p_id += 1
        targets.append(tokens[i + 1] if i + 1 < T and t != eos else -1)
    pos, doc, targets = torch.tensor(pos), torch.tensor(doc), torch.tensor(targets)
    eps = cfg['norm_eps']
    pattern = cfg['layer_pattern']
    x = W['embed.weight'][ids]
    for li in range(cfg['n_layers']):
        p = f'layers.{li}.'
        h = rms(x, W[p + 'attn_norm.weight'], eps)
        if pattern[li % len(pattern)] == 'L':
            x = x + lightning(W, p, h, li, cfg, pos, starts)
        else:
            x = x + mla(W, p, h, cfg, pos, doc)
        h = rms(x, W[p + 'ffn_norm.weight'], eps)
        moe = cfg.get('moe', {})
        if moe.get('experts', 0) > 0 and li >= moe.get('first_dense', 0):
            y, _ = moe_ffn(W, p, h, cfg)
            x = x + y
        else:
            x = x + swiglu(h, W[p + 'ffn.w1.weight'], W[p + 'ffn.w3.weight'], W[p + 'ffn.w2.weight'])
    logits = rms(x, W['final_norm.weight'], eps) @ W['lm_head.weight'].T
    valid = targets >= 0
    lp = torch.log_softmax(logits, -1)
    nll = -lp[torch.arange(T)[valid], targets[valid]]
    objective = nll.sum()
    if z_loss > 0:
        objective = objective + z_loss * (torch.logsumexp(logits[valid], -1) ** 2).sum()
    return objective, int(valid.sum())


def sequence_loss(W, cfg, tokens, eos):
    nll, count = sequence_nll(W, cfg, tokens, eos)
    return float(nll), count


def main():
    ckpt, tokens_path, seq_len, n_seq, eos = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    cfg = json.load(open(ckpt + '/state.json'))['model']
    W = load_safetensors(ckpt + '/model.safetensors')
    raw = open(tokens_path, 'rb').read()
    stream = list(struct.unpack('<%dH' % (len(raw) // 2), raw))
    total, count = 0.0, 0
    for n in range(n_seq):
        seq = [stream[(n * seq_len + i) % len(stream)] for i in range(seq_len)]
        s, c = sequence_loss(W, cfg, seq, eos)
        total, count = total + s, count + c
    print(json.dumps({'loss': total / count, 'tokens': count}))


if __name__ == '__main__':
    main()
