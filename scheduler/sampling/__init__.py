"""Sampling: one batched pass, penalties kept on the device, grammar masks for constrained rows."""
