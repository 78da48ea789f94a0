"""Thin network adapters: ext_proc gRPC, HTTP (metrics, health)."""
