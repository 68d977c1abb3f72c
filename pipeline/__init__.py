"""The competition pipeline: validate -> evaluate -> report -> ledger -> board."""
