"""The decoding machinery every drafter shares: draft trees, acceptance rules, sampling, the speculative
loop (verifier), context lookup, the metric definitions and the evaluation settings."""
