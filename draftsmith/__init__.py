"""draftsmith: train draft heads for speculative decoding and prove what they are worth."""
__version__ = "0.1.0"
