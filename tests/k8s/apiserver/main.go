// The real Kubernetes CRD API server (k8s.io/apiextensions-apiserver: the CRD half of
// kube-apiserver, with its validation, defaulting, CEL, status subresource, watch and server-side
// dry run) as one binary for the tests, built by build.sh from Debian's Go sources.
//
// What differs from a cluster: no authentication or authorization (every request is anonymous
// and allowed), no admission, no API priority and fairness, and no core/v1: /api lists v1 with
// only `namespaces` (listing them answers 403, which kopf treats as "use the given namespaces")
// and every other /api path answers a JSON Status 404. Core informers come from an empty fake
// clientset. /apis (which kube-apiserver's aggregator serves) lists apiextensions.k8s.io and the
// groups of the established CRDs, in the legacy APIGroupList form (clients asking for aggregated
// discovery fall back to it).
//
// Flags are upstream's (--etcd-servers, --secure-port, --cert-dir, ...); it prints nothing of
// its own and serves until SIGTERM.
package main

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strings"

	"github.com/spf13/pflag"

	"k8s.io/apiextensions-apiserver/pkg/apihelpers"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apiextensions-apiserver/pkg/apiserver"
	crdlisters "k8s.io/apiextensions-apiserver/pkg/client/listers/apiextensions/v1"
	"k8s.io/apiextensions-apiserver/pkg/cmd/server/options"
	generatedopenapi "k8s.io/apiextensions-apiserver/pkg/generated/openapi"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apiserver/pkg/authentication/request/anonymous"
	"k8s.io/apiserver/pkg/authorization/authorizerfactory"
	openapinamer "k8s.io/apiserver/pkg/endpoints/openapi"
	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/apiserver/pkg/util/openapi"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/kubernetes/scheme"
	netutils "k8s.io/utils/net"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "apiextensions-apiserver:", err)
		os.Exit(1)
	}
}

func run() error {
	o := options.NewCustomResourceDefinitionsServerOptions(os.Stdout, os.Stderr)
	fs := pflag.NewFlagSet("apiextensions-apiserver", pflag.ExitOnError)
	o.AddFlags(fs)
	if err := fs.Parse(os.Args[1:]); err != nil {
		return err
	}
	if err := o.ServerRunOptions.ComponentGlobalsRegistry.Set(); err != nil {
		return err
	}
	rec := o.RecommendedOptions
	rec.Authentication = nil
	rec.Authorization = nil
	rec.Admission = nil
	rec.CoreAPI = nil
	rec.Features.EnablePriorityAndFairness = false
	if err := o.Complete(); err != nil {
		return err
	}
	if err := o.Validate(); err != nil {
		return err
	}
	if err := rec.SecureServing.MaybeDefaultWithSelfSignedCerts(
		"localhost", nil, []net.IP{netutils.ParseIPSloppy("127.0.0.1")}); err != nil {
		return err
	}

	// options.Config(), with the core informers of an empty fake clientset in place of a cluster's.
	cfg := genericapiserver.NewRecommendedConfig(apiserver.Codecs)
	cfg.SharedInformerFactory = informers.NewSharedInformerFactory(fake.NewSimpleClientset(), 0)
	if err := o.ServerRunOptions.ApplyTo(&cfg.Config); err != nil {
		return err
	}
	if err := rec.ApplyTo(cfg); err != nil {
		return err
	}
	cfg.Authentication.Authenticator = anonymous.NewAuthenticator(nil)
	cfg.Authorization.Authorizer = authorizerfactory.NewAlwaysAllowAuthorizer()
	if err := o.APIEnablement.ApplyTo(&cfg.Config, apiserver.DefaultAPIResourceConfigSource(), apiserver.Scheme); err != nil {
		return err
	}
	defs := openapi.GetOpenAPIDefinitionsWithoutDisabledFeatures(generatedopenapi.GetOpenAPIDefinitions)
	namer := openapinamer.NewDefinitionNamer(apiserver.Scheme, scheme.Scheme)
	// Both: the CRD OpenAPI controllers start only when the v2 spec exists.
	cfg.OpenAPIConfig = genericapiserver.DefaultOpenAPIConfig(defs, namer)
	cfg.OpenAPIV3Config = genericapiserver.DefaultOpenAPIV3Config(defs, namer)

	var crds crdlisters.CustomResourceDefinitionLister // set once the server exists, before it serves
	cfg.BuildHandlerChainFunc = func(h http.Handler, c *genericapiserver.Config) http.Handler {
		chain := genericapiserver.DefaultBuildHandlerChain(h, c)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet && strings.TrimSuffix(r.URL.Path, "/") == "/apis" {
				writeJSON(w, http.StatusOK, groupList(crds))
				return
			}
			chain.ServeHTTP(w, r)
		})
	}

	config := &apiserver.Config{
		GenericConfig: cfg,
		ExtraConfig: apiserver.ExtraConfig{
			CRDRESTOptionsGetter: options.NewCRDRESTOptionsGetter(*rec.Etcd, cfg.ResourceTransformers, cfg.StorageObjectCountTracker),
			ServiceResolver:      noServices{},
			AuthResolverWrapper:  nil,
		},
	}
	server, err := config.Complete().New(genericapiserver.NewEmptyDelegate())
	if err != nil {
		return err
	}
	crds = server.Informers.Apiextensions().V1().CustomResourceDefinitions().Lister()
	mux := server.GenericAPIServer.Handler.NonGoRestfulMux
	mux.HandleFunc("/api", serveCoreVersions)
	mux.HandlePrefix("/api/", http.HandlerFunc(serveCoreStub))
	return server.GenericAPIServer.PrepareRun().RunWithContext(genericapiserver.SetupSignalContext())
}

type noServices struct{}

func (noServices) ResolveEndpoint(namespace, name string, port int32) (*url.URL, error) {
	return nil, fmt.Errorf("no Services in this server (service %s/%s)", namespace, name)
}

func writeJSON(w http.ResponseWriter, code int, obj any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(obj)
}

// groupList is /apis: apiextensions.k8s.io, then each established CRD's group with its served
// versions (the storage version preferred).
func groupList(crds crdlisters.CustomResourceDefinitionLister) metav1.APIGroupList {
	ext := metav1.GroupVersionForDiscovery{GroupVersion: "apiextensions.k8s.io/v1", Version: "v1"}
	groups := []metav1.APIGroup{{Name: "apiextensions.k8s.io", Versions: []metav1.GroupVersionForDiscovery{ext}, PreferredVersion: ext}}
	all, _ := crds.List(labels.Everything())
	sort.Slice(all, func(i, j int) bool { return all[i].Name < all[j].Name })
	index := map[string]int{}
	for _, crd := range all {
		if !apihelpers.IsCRDConditionTrue(crd, apiextensionsv1.Established) {
			continue
		}
		for _, v := range crd.Spec.Versions {
			if !v.Served {
				continue
			}
			gv := metav1.GroupVersionForDiscovery{GroupVersion: crd.Spec.Group + "/" + v.Name, Version: v.Name}
			i, ok := index[crd.Spec.Group]
			if !ok {
				groups = append(groups, metav1.APIGroup{Name: crd.Spec.Group, PreferredVersion: gv})
				i = len(groups) - 1
				index[crd.Spec.Group] = i
			}
			seen := false
			for _, have := range groups[i].Versions {
				seen = seen || have == gv
			}
			if !seen {
				groups[i].Versions = append(groups[i].Versions, gv)
			}
			if v.Storage {
				groups[i].PreferredVersion = gv
			}
		}
	}
	return metav1.APIGroupList{TypeMeta: metav1.TypeMeta{Kind: "APIGroupList", APIVersion: "v1"}, Groups: groups}
}

func serveCoreVersions(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{
		"kind": "APIVersions", "versions": []string{"v1"},
		"serverAddressByClientCIDRs": []map[string]string{{"clientCIDR": "0.0.0.0/0", "serverAddress": r.Host}},
	})
}

func serveCoreStub(w http.ResponseWriter, r *http.Request) {
	path := strings.TrimSuffix(r.URL.Path, "/")
	switch path {
	case "/api/v1":
		writeJSON(w, http.StatusOK, map[string]any{
			"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "v1",
			"resources": []map[string]any{{
				"name": "namespaces", "singularName": "namespace", "namespaced": false,
				"kind": "Namespace", "verbs": []string{"get", "list", "watch"},
			}},
		})
	case "/api/v1/namespaces":
		writeJSON(w, http.StatusForbidden, status(http.StatusForbidden, metav1.StatusReasonForbidden,
			"namespaces are not served by the apiextensions-apiserver"))
	default:
		writeJSON(w, http.StatusNotFound, status(http.StatusNotFound, metav1.StatusReasonNotFound,
			"no core/v1 in the apiextensions-apiserver: "+path))
	}
}

func status(code int32, reason metav1.StatusReason, message string) metav1.Status {
	return metav1.Status{
		TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"},
		Status:   metav1.StatusFailure, Code: code, Reason: reason, Message: message,
	}
}
