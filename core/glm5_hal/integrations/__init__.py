"""Bridges from other frameworks' model code to glm5_hal ops, one submodule per framework
(`glm5_hal.integrations.transformers`: HF transformers' GLM-5). Each submodule imports its
framework; importing this package, like importing glm5_hal, imports none of them."""
