module github.com/kvsp/kvsp

go 1.26

require (
	github.com/go-json-experiment/json v1.27.2
	github.com/gowebpki/jcs v1.0.2
)

require go.uber.org/goleak v1.3.0
