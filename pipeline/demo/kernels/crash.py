"""Demo submission for muse_bf16_proj that crashes: it reads an input the problem does not have."""

import torch.nn.functional as F


def custom_kernel(inputs):
    return F.linear(inputs["x"], inputs["weight"])  # the weight is inputs["w"]: KeyError
