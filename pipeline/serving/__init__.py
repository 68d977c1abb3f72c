"""The serving track: a competitor's SGLang patch.diff, applied to the pinned tree, served and replayed.

One module per stage of the flow, each testable alone and each adding its commands to
`python -m pipeline serving` (pipeline/serving/cli.py):

  pin      fetch and verify the pinned SGLang source (sglang_pin/pin.toml), cached
  gate     a patch.diff -> accepted (with flags) or every reason to refuse it
  dataset  generate and check the agentic multi-turn conversations
  engine   launch templates and the per-engine request adapters
  replay   the closed-loop client: lanes, history, streaming, client-side token counts
  metrics  T_c, I_c and the unscored figures from a replay's records
  score    the serving score S and the correctness gate G
"""
