import pytest

from gqa_tiny_models import FAMILIES


@pytest.fixture(params=list(FAMILIES))
def model_type(request):
    return request.param
