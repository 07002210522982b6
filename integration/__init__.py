"""Adapters that plug pipeschedule into training frameworks (today: nanotron)."""
