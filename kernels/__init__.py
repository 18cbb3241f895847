"""tandem's tensor ops: a torch reference for every op, Triton versions where they pay off.

Import the ops through `kernels.ops`; it picks the implementation for the device. (The Hugging
Face `kernels` hub package shares this import name; transformers only uses that one when its
distribution metadata is installed, which ours is not: our distribution is `tandem`.)
"""
