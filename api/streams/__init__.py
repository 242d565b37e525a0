"""The Server-Sent Event engine: the response every stream goes out through, its frames,
writes and ids, the bounded stream opens, and the push hubs. No route and no `AppState`
here: what a stream needs is handed to it."""
