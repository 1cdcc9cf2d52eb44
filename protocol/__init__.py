"""The concepts every layer shares, declared once, as plain types (no torch, no
internal imports): sampling parameters and their ranges, token logprobs, the KV layout
and its hash, the block-hash chain, finish reasons. Every package may import this one.
"""
