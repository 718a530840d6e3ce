"""What the verifier's training-side forward yields besides its loss.

``logprobs``: token log-probs from vocab-parallel logits (no vocabulary gather).
"""
