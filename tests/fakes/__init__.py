"""Test doubles: small stand-ins for external services, speaking their documented APIs."""
