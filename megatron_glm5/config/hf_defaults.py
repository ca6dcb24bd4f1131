"""What an absent HF ``config.json`` key means: the defaults of transformers' own GLM-5.3 config classes
(``transformers.models.glm5_next.configuration_glm5_next``), read from their dataclass fields.

These are the one home of every HF-named default in this package: ``Glm5Config`` / ``Glm5VisionConfig`` take their
HF-named field defaults from here, and ``Glm5Config.from_hf`` fills the keys a config.json leaves out from here, so
a config.json lacking e.g. ``n_routed_experts`` builds the sizes ``Glm5NextTextConfig`` would build from it.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping

from transformers.models.glm5_next.configuration_glm5_next import (
    Glm5NextConfig,
    Glm5NextTextConfig,
    Glm5NextVisionConfig,
)


def _field_defaults(cls) -> Mapping:
    return MappingProxyType({f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING})


HF_TEXT_DEFAULTS = _field_defaults(Glm5NextTextConfig)
"""``Glm5NextTextConfig``'s field defaults (``text_config`` keys: vocab_size, hidden_size, n_routed_experts, ...)."""
HF_VISION_DEFAULTS = MappingProxyType({**_field_defaults(Glm5NextVisionConfig),
                                       "rope_theta": Glm5NextVisionConfig.default_theta})
"""``Glm5NextVisionConfig``'s field defaults (``vision_config`` keys), with ``rope_theta`` the base transformers
puts into ``rope_parameters`` when a config gives none (``default_theta``)."""
HF_TOP_DEFAULTS = _field_defaults(Glm5NextConfig)
"""``Glm5NextConfig``'s field defaults (the top-level keys: image / video token ids, tie_word_embeddings)."""
