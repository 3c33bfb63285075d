//go:build !nogpu

package tier

const standInBuild = false
