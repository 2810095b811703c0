"""The fused decode ops' switch rule (dsv4_model.layers.fused_on): on unless the environment variable is 0."""
from dsv4_model import layers


def test_fused_switch_rule(monkeypatch):
    env = "DSV4_FUSED_TEST_SWITCH"
    monkeypatch.delenv(env, raising=False)
    assert layers.fused_on(env)
    monkeypatch.setenv(env, "0")
    assert not layers.fused_on(env)
    monkeypatch.setenv(env, "1")
    assert layers.fused_on(env)
