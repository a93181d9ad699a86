"""Plain data shared by every layer: requests and their sampling parameters, step records, token trees, logprobs,
spec-decode counters, and the policy's typed view of a step and its plan. No behaviour beyond small helpers."""
