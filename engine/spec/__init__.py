"""Speculative decoding: draft a few tokens cheaply, verify them in one target pass.

`ngram` proposes drafts by prompt lookup (no second model); `verify` decides which
drafted tokens the target model accepts, keeping its output distribution exact.
"""
