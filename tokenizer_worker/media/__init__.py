"""Fetching a part's bytes: data: URLs, http(s) under the host rules, local files under the allowed folder."""
