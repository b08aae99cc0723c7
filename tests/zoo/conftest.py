"""The zoo's tests import transformers, timm and torchvision, which need torchvision's
two operator schemas declared first on the CPU build of torch (see _schemas.py)."""

from tests.zoo._schemas import declare_torchvision_schemas

declare_torchvision_schemas()
