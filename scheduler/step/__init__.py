"""The engine's step: admission, planning, the forward, accounting, and the policy that paces prefill."""
