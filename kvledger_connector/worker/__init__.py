"""The worker side: the store and load jobs' steps (`steps`: `saves` and `loads` over `base`, with `sent`,
`cache`, `effects`) and the threads that run them (`side`)."""
