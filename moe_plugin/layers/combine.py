"""Combine: each token's gate-weighted sum of its routes' expert outputs, as one autograd function:
``out_TH[t]`` = the sum over the kept routes r of token t of ``gate_R[r] * y_RH[r]``, in fp32 in a
fixed order (deterministic on any device); a dropped route adds nothing, even a non-finite row.

Shape suffixes: see ``moe_plugin.layers``; how: docs/design/layers_exchange.md.
"""
from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ROWS = 1024


def inverse_routes(route_R: Tensor, num_tokens: int, k: int) -> Tensor:
    """``row_KT``: the row of each route slot ``j * T + t``, -1 where the route was dropped."""
    row_KT = torch.full((k * num_tokens,), -1, dtype=torch.long, device=route_R.device)
    row_KT[route_R] = torch.arange(route_R.numel(), device=route_R.device)
    return row_KT.view(k, num_tokens)


class GateCombine(torch.autograd.Function):
    """``out_TH`` of the module docstring from ``y_RH, gate_R, token_R, row_KT``."""

    @staticmethod
    def forward(ctx, y_RH, gate_R, token_R, row_KT):
        K, T = row_KT.shape
        out_TH = y_RH.new_empty(T, y_RH.shape[-1])
        if y_RH.shape[0] == 0:
            out_TH.zero_()
        else:
            kept_KT = row_KT >= 0
            safe_KT = row_KT.clamp(min=0)
            gate_KT = torch.where(kept_KT, gate_R.detach().float()[safe_KT], 0.0)
            for t0 in range(0, T, CHUNK_ROWS):
                t1 = min(T, t0 + CHUNK_ROWS)
                acc_CH = out_TH[t0:t1] if out_TH.dtype == torch.float32 else None
                for j in range(K):
                    rows_CH = y_RH.index_select(0, safe_KT[j, t0:t1]).float()
                    rows_CH.masked_fill_(~kept_KT[j, t0:t1, None], 0)
                    if acc_CH is None:
                        acc_CH = rows_CH.mul_(gate_KT[j, t0:t1, None])
                    elif j == 0:
                        torch.mul(rows_CH, gate_KT[j, t0:t1, None], out=acc_CH)
                    else:
                        acc_CH.addcmul_(rows_CH, gate_KT[j, t0:t1, None])
                if acc_CH.data_ptr() != out_TH[t0:t1].data_ptr():
                    out_TH[t0:t1] = acc_CH
        ctx.save_for_backward(y_RH if ctx.needs_input_grad[1] else None, gate_R.detach(), token_R)
        return out_TH

    @staticmethod
    def backward(ctx, grad_TH):
        y_RH, gate_R, token_R = ctx.saved_tensors
        need_y, need_gate = ctx.needs_input_grad[:2]
        R = token_R.numel()
        grad_y_RH = grad_TH.new_empty(R, grad_TH.shape[-1]) if need_y else None
        grad_gate_R = torch.empty(R, dtype=torch.float32, device=grad_TH.device) if need_gate else None
        for r0 in range(0, R, CHUNK_ROWS):
            r1 = min(R, r0 + CHUNK_ROWS)
            g_CH = grad_TH.index_select(0, token_R[r0:r1])
            if need_gate:
                grad_gate_R[r0:r1] = torch.linalg.vecdot(g_CH.float(), y_RH[r0:r1].float())
            if need_y and g_CH.dtype == torch.float32:
                torch.mul(g_CH, gate_R[r0:r1, None], out=grad_y_RH[r0:r1])
            elif need_y:                       # in fp32, rounded once on the way in
                grad_y_RH[r0:r1] = g_CH.float() * gate_R[r0:r1, None]
        return grad_y_RH, grad_gate_R, None, None


def gate_combine(y_RH: Tensor, gate_R: Tensor, token_R: Tensor, route_R: Tensor, num_tokens: int, k: int) -> Tensor:
    """``out_TH`` of the module docstring, in ``y_RH``'s dtype (summed in fp32)."""
    if not (y_RH.shape[0] == gate_R.numel() == token_R.numel() == route_R.numel()):
        raise ValueError(f"combine needs one gate, token and route per row: {y_RH.shape[0]} rows, "
                         f"{gate_R.numel()} gates, {token_R.numel()} tokens, {route_R.numel()} routes")
    return GateCombine.apply(y_RH.contiguous(), gate_R, token_R, inverse_routes(route_R, num_tokens, k))
