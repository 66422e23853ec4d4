"""Test doubles shipped with plaserve, for tests and benchmark scripts: :mod:`plaserve.testing.fake_gpu`
(an OpenAI-compatible server that fakes a GPU's timing with a cost model), :mod:`plaserve.testing.odd_values`
(values no request field should have, and a body's variants with each),
:mod:`plaserve.testing.plain_sampler` (sampling written the plain way: the sampler's reference)."""
