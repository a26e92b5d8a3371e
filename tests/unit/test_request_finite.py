"""Request fields that are floats refuse NaN and infinities with pydantic's "finite number"
error (the HTTP layer turns it into a 400 naming the field), not a misleading range message."""

import math

import pytest
from pydantic import ValidationError

from server.protocol import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "min_p"])
def test_non_finite_sampling_floats_are_refused(field, value):
    for make in (
        lambda: ChatCompletionRequest(messages=MESSAGES, **{field: value}),
        lambda: CompletionRequest(prompt="x", **{field: value}),
    ):
        with pytest.raises(ValidationError) as e:
            make()
        (err,) = e.value.errors()
        assert err["type"] == "finite_number" and err["loc"] == (field,), err


def test_non_finite_logit_bias_is_refused_and_finite_values_pass():
    with pytest.raises(ValidationError, match="finite number"):
        CompletionRequest(prompt="x", logit_bias={"5": math.nan})
    req = CompletionRequest(prompt="x", temperature=1.5, logit_bias={"5": -100.0})
    assert req.temperature == 1.5 and req.logit_bias == {"5": -100.0}
