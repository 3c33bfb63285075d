//go:build nogpu

package tier

const standInBuild = true
