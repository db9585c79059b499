"""Test backends: one available (fakeaccel), one whose probe says no (offline)."""
