package client

import (
	"context"
	"net/http"
)

// DoForTest exposes doJSON to the tests with a StateBody answer.
func DoForTest(c *Client, ctx context.Context, method, url string) (int, http.Header, error) {
	return c.doJSON(ctx, method, url, nil, nil)
}
