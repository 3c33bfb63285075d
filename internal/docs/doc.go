// Package docs holds the tests that keep README.md and docs/ honest:
// nothing of the README from before it became a front page is lost
// (testdata/readme-6c89cf3.inventory: its headings and table rows, made
// with
//
//	git show 6c89cf3:README.md | awk '/^```/{c=!c; next} c{next}
//	    /^#+ /{sub(/^#+ /,""); print "H " $0; next}
//	    /^\|/ && !/^\|[-| :]+\|$/ {print "R " $0}'
//
// ), and every link to a file or a heading resolves.
package docs
